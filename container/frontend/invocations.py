"""The routes the handler answers (SageMaker's ``/invocations``, the OpenAI-compatible ones and
Anthropic's Messages), relayed to worker groups through the ``Router``.

They are served by a WSGI app of their own in front of Flask (``HandlerRoutes``): a
request on one of them with its method is answered here, everything else (other
methods, ``/ping``, the management routes ...) goes on to Flask, whose dispatch (its
contexts, URL matching, hooks and response objects) would cost more than the rest of the
relay at one stream.

Request path: read the body (413 past the limit, without reading it), admit (503 when
the queue is full or the server is draining), pick a worker group, send, wait for the
head (504 after ``predict_timeout``), then either return the body or stream it chunk by
chunk (HTTP/1.1 chunked) as the group produces it. A client that disconnects mid-stream
cancels its request in the group.
"""

from __future__ import annotations

import errno
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from werkzeug.datastructures import EnvironHeaders
from werkzeug.http import HTTP_STATUS_CODES
from werkzeug.wsgi import get_content_length

from container.core.errors import (
    ClientClosedRequest,
    GatewayTimeout,
    QueueFull,
    RequestStoppedEngine,
    ServingError,
    describe,
    envelope_for,
    in_band_error,
)
from container.core.ingress import DEFAULT_CONTENT_TYPE, GROUP_HEADER, fingerprint, request_properties
from container.core.launch import FrontendLaunch
from container.core.logs import request_id_var
from container.core.protocol import Invoke
from container.core.sessions import SESSION_ID
from container.core.tracing import Headers, Tracer
from container.frontend.body import read_body
from container.frontend.client import CLIENT_CHECK_INTERVAL, ClientSink, client_gone
from container.frontend.completion import INFERENCE_ID, Answer, Completion, Exchange, RequestLog
from container.frontend.group_client import GroupClient
from container.frontend.pending import PendingRequest, WorkerFailed
from container.frontend.router import Router

log = logging.getLogger("sagelmi.frontend")

# The handler's routes and the method each answers (Flask answers the others on these paths: 405, OPTIONS, HEAD)
ROUTES = {
    "/invocations": "POST",
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/models": "GET",
    "/tokenize": "POST",
    "/detokenize": "POST",
    "/v1/embeddings": "POST",
    "/v1/score": "POST",
    "/v1/rerank": "POST",
    "/v1/responses": "POST",
    "/v1/messages": "POST",
    "/v1/messages/count_tokens": "POST",
}
STOP_CONFIRM_TIMEOUT = 2.0  # how long a timed-out stream waits for its group to stop writing to the client


@dataclass
class Reply:
    """An answer to send: a whole body, or the chunks of a stream."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | Iterator[bytes] = b""
    after: Callable[[], None] | None = None  # called after the completion line (_Closing)


def error_reply(path: str, exc: BaseException) -> Reply:
    """The error in the envelope of the route the client called."""
    status, message, error = describe(exc)
    body = json.dumps(envelope_for(path, status, message, error)).encode()
    return Reply(status, {"Content-Type": "application/json"}, body)


def count_refusal(metrics, exc: ServingError) -> None:
    """The counters of requests refused before they reached a group."""
    if isinstance(exc, RequestStoppedEngine):
        metrics.poison_refused.inc()
    elif isinstance(exc, QueueFull):
        metrics.queue_full.inc()


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
        environ: dict,
        headers: Headers,
        request_id: str,
        trace_headers: dict[str, str] | None = None,
    ) -> None:
        self.router = router
        self.launch = launch
        self.environ = environ  # the stream is written after the request's call returned
        self.headers = headers
        self.request_id = request_id
        self.client = environ.get("gunicorn.socket")
        self.path = environ.get("PATH_INFO", "")
        self.query = environ.get("QUERY_STRING", "")
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

    def abandon(self, confirm: bool = False) -> None:
        if self.group is not None:
            self.group.cancel(self.wire_id, confirm)

    def _group_stopped_writing(self) -> bool:
        """After cancelling a body the group wrote to the client itself, or after its ending ``End``:
        whether it said it stopped (nothing else may be written to the client before)."""
        stopped = self.submitted.wait_done_for(STOP_CONFIRM_TIMEOUT)
        if self.group is not None:
            self.group.forget(self.wire_id)
        return stopped

    def run(self) -> Reply:
        body = read_body(
            self.environ, get_content_length(self.environ), self.launch.max_payload_bytes, self.launch.body_read_timeout
        )
        print_ = fingerprint(f"{self.path}?{self.query}", body)
        self.router.poison.check(print_)
        self.router.admit()
        admitted = time.monotonic()
        streaming = False
        try:
            session_id = self.headers.get(SESSION_ID)
            incarnation = self._submit(body, print_, session_id)
            group, pending = self.group, self.submitted
            assert group is not None  # picked by _submit
            try:
                self._await(pending.wait_head_for, "no answer from the model")
                head = pending.wait_head(0)
            except ServingError:
                self._abandon_before_head()
                raise
            try:
                if head.started:  # the same clock in every process of the machine
                    self.answer.queue_wait = head.started - admitted
                headers = self.router.sessions.observe(session_id, group, incarnation, head.code, head.headers)
                headers[GROUP_HEADER] = group.name
                if head.stream:
                    streaming = self.answer.streamed = True
                    relay = self._relay(headers.get("content-type", ""))
                    return Reply(head.code, headers, relay)
                body = self._body()
                self._count_tokens()
                return Reply(head.code, headers, body)
            except ServingError:
                self.abandon()
                raise
        finally:
            if not streaming:
                self.release()

    def _submit(self, body: bytes, print_: str, session_id: str | None) -> int:
        """Send the request to a group; which start of the group that is (its incarnation)."""
        self.group = group = self.router.pick_for(session_id)
        incarnation = group.incarnation
        self.pending = self.group.submit(
            Invoke(
                id=self.wire_id,
                properties=request_properties(self.headers.items(), self.request_id, self.trace_headers),
                body=body,
                path=self.path,
                query=self.query,
            ),
            tag=(print_, self.request_id, self.path),
        )
        return incarnation

    def _abandon_before_head(self) -> None:
        """The request failed, timed out or lost its client before the frontend took its head."""
        if not self.submitted.done:
            self.abandon()

    def _await(self, wait: Callable[[float], bool], what: str) -> None:
        """Wait (``wait(seconds)``, True once ready) up to ``predict_timeout``;
        raises ``GatewayTimeout``, or ``ClientClosedRequest`` as soon as the
        client is seen gone. Time counts from the request's last message: a
        stream the reader thread writes itself moves on without waking this
        thread."""
        pending = self.submitted
        deadline = pending.progress_at + self.launch.predict_timeout
        progress = pending.progress
        while not wait(min(CLIENT_CHECK_INTERVAL, max(deadline - time.monotonic(), 0))):
            if pending.progress != progress:
                progress = pending.progress
                deadline = pending.progress_at + self.launch.predict_timeout
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
        counted = self.submitted.tokens
        if counted is not None:
            self.answer.prompt_tokens, self.answer.completion_tokens = counted

    def _relay(self, content_type: str) -> Iterator[bytes]:
        request_id_var.set(self.request_id)
        finished = False
        in_band = b""
        pending = self.submitted
        try:
            yield b""  # gunicorn sends the headers and nothing else: the body is the group's to write
            assert self.group is not None  # run() picked it
            self.group.attach(pending, ClientSink.of(self.environ))
            while (data := self._next()) is not None:
                yield data
            finished = True
            self.answer.outcome = "completed"
        except ClientClosedRequest:
            pass  # cancelled below, as when a write finds the client gone
        except ServingError as exc:
            finished = True
            if isinstance(exc, WorkerFailed) and exc.status == ClientClosedRequest.status:
                self.answer.outcome = "client_gone"  # the group found the client gone while writing to it
                return
            self.answer.outcome = "timeout" if isinstance(exc, GatewayTimeout) else "error"
            if isinstance(exc, GatewayTimeout):
                self.abandon(confirm=pending.direct)
                if pending.direct and not self._group_stopped_writing():
                    # bytes of ours could land in the middle of its: close the connection instead
                    raise BrokenPipeError(errno.EPIPE, "the group did not stop writing the stream") from None
            log.warning("stream ended with an error: %s", exc)
            if pending.direct and pending.torn:
                # the client's socket holds part of a chunk the group wrote (it went away, or gave up
                # the rest): nothing may follow that part, so the connection is closed
                raise BrokenPipeError(errno.EPIPE, "the group went away in the middle of an HTTP chunk") from None
            try:
                self.submitted.take_over()
            except ClientClosedRequest:
                self.answer.outcome = "client_gone"
                return  # the client is gone too
            in_band = in_band_error(self.path, content_type, exc)
            yield in_band
        finally:
            if not finished:
                log.info("client went away during the stream; cancelling the request")
                self.answer.outcome = "client_gone"
                self.abandon(confirm=pending.direct)
                if pending.direct:  # its last word says how much of the body it wrote
                    self._group_stopped_writing()
            self.answer.bytes = self.submitted.body_bytes + len(in_band)
            self._count_tokens()
            self.release()


class _Closing:
    """A response body whose ``close`` (gunicorn calls it once the response is sent,
    or abandoned) closes the stream, then writes the completion line."""

    __slots__ = ("after", "body", "completion")

    def __init__(self, body: Iterable[bytes], completion: Completion, after: Callable[[], None] | None = None) -> None:
        self.body = body
        self.completion = completion
        self.after = after

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.body)

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            try:
                self.completion()
            finally:
                if self.after is not None:
                    self.after()


class HandlerRoutes:
    """WSGI middleware in front of Flask that serves the handler's ``ROUTES``."""

    def __init__(
        self,
        router: Router,
        launch: FrontendLaunch,
        requests: RequestLog,
        tracer: Tracer | None,
        fallback: Callable,
    ) -> None:
        self.router = router
        self.launch = launch
        self.requests = requests
        self.tracer = tracer
        self.fallback = fallback  # Flask's WSGI app

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        method = environ["REQUEST_METHOD"]
        if ROUTES.get(path) != method:
            return self.fallback(environ, start_response)
        headers = EnvironHeaders(environ)
        exchange = self.requests.begin(headers, method, path, path)
        try:
            try:
                reply = self.serve(environ, headers, exchange)
            except ServingError as exc:
                count_refusal(self.requests.metrics, exc)
                reply = error_reply(path, exc)
            except Exception:
                log.exception("unexpected error")
                reply = error_reply(path, ServingError())
            return self.respond(reply, exchange, start_response)
        finally:
            request_id_var.set("-")

    def serve(self, environ: dict, headers: Headers, exchange: Exchange) -> Reply:
        """Relay the request to a worker group: its answer, or its stream (raises what the relay refuses)."""
        span = exchange.span
        trace_headers = self.tracer.headers_of(span) if self.tracer is not None and span is not None else None
        invocation = Invocation(self.router, self.launch, environ, headers, exchange.request_id, trace_headers)
        exchange.answer = invocation.answer
        return invocation.run()

    def respond(self, reply: Reply, exchange: Exchange, start_response: Callable) -> Iterable[bytes]:
        headers = list(reply.headers.items())
        if not any(name.lower() == "content-type" for name, _ in headers):
            headers.append(("Content-Type", DEFAULT_CONTENT_TYPE))
        body: Iterable[bytes]
        if isinstance(reply.body, bytes):
            body, length = (reply.body,), len(reply.body)
            if not (100 <= reply.status < 200 or reply.status in (204, 304)):
                headers.append(("Content-Length", str(length)))
        else:
            body, length = reply.body, None
        headers.append((INFERENCE_ID, exchange.request_id))
        completion = self.requests.finish(exchange, reply.status, length)
        status = f"{reply.status} {HTTP_STATUS_CODES.get(reply.status, 'unknown').upper()}"
        try:
            start_response(status, headers)
        except BaseException:
            _Closing(body, completion, reply.after).close()
            raise
        return _Closing(body, completion, reply.after)
