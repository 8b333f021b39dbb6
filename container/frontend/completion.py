"""Each request from its arrival to its completion line, written when its answer has ended.

``RequestLog.begin`` starts an ``Exchange`` when a request arrives (its id, its
span); ``RequestLog.finish`` observes its time to the status line and gives the
``Completion`` the server calls when it closes the response (after the last byte
was handed to the connection, or once the client was found gone), which is when a
stream's relay has ended too. The ``Completion`` logs the line (route, status,
outcome, duration, time to the first byte, body bytes, tokens in and out when the
worker group counted them), observes the duration histograms and ends the request's
span. The handler's routes (``container/frontend/invocations.py``) and Flask's
(``container/frontend/app.py``) both use it.

Outcomes: ``completed`` (the answer went out whole; its status may still be a
4xx), ``client_gone`` (the client left first: 499, or a stream cut short),
``timeout`` (504, or a stream that stopped for ``predict_timeout``), ``error``
(any other 5xx, or a stream ended by an in-band error).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from container.core.ingress import INFERENCE_ID
from container.core.logs import request_id_var
from container.core.tracing import Headers, Tracer
from container.frontend.metrics import FrontendMetrics

log = logging.getLogger("sagelmi.frontend")


@dataclass
class Answer:
    """What the frontend learns about an answer rank 0 wrote (``early.HandedOff`` fills it in)."""

    streamed: bool = False
    outcome: str | None = None  # a stream's, set when its relay ends; else from the status
    bytes: int = 0  # body bytes relayed (a stream's, with an in-band error)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    queue_wait: float | None = None  # admission to the handler call beginning in the group


@dataclass
class Exchange:
    """One request, from its arrival (``RequestLog.begin``) to its completion line."""

    request_id: str
    method: str
    path: str
    route: str  # the route's pattern (the path of a handler's route)
    started: float  # time.monotonic() at the request's arrival
    span: Any = None
    answer: Answer | None = None  # what the relay learnt (a request relayed to a worker group)


class RequestLog:
    """Starts and ends the ``Exchange`` of every request the frontend logs."""

    def __init__(self, metrics: FrontendMetrics, tracer: Tracer | None) -> None:
        self.metrics = metrics
        self.tracer = tracer

    def begin(
        self,
        headers: Headers,
        method: str,
        path: str,
        route: str,
        traced: bool = True,
        bind: bool = True,
    ) -> Exchange:
        """A request arrived: its id (the client's ``INFERENCE_ID``, else a new one) becomes
        the context's for the log (unless not ``bind``: the main loop's, which serves many), and
        with tracing on (and ``traced``) its span starts."""
        request_id, started = headers.get(INFERENCE_ID) or uuid.uuid4().hex, time.monotonic()
        if bind:
            request_id_var.set(request_id)
        exchange = Exchange(request_id, method, path, route, started)
        if self.tracer is not None and traced:
            attributes = {"http.request.method": method, "url.path": path, "http.route": route}
            exchange.span = self.tracer.start(f"{method} {route}", headers, attributes, server=True)
            exchange.span.set_attribute("sagelmi.request_id", request_id)
        return exchange

    def finish(self, exchange: Exchange, status: int, body_bytes: int | None, sent_at: float = 0.0) -> Completion:
        """Its status line is about to go out (or went out at ``sent_at``, written by a worker
        group): observe the time to it, and return what to call once the response is closed
        (``body_bytes``: a whole body's length)."""
        first_byte = (sent_at or time.monotonic()) - exchange.started
        self.metrics.requests.labels(exchange.route, str(status)).inc()
        self.metrics.first_byte.labels(exchange.route).observe(first_byte)
        return Completion(
            self.metrics,
            exchange.request_id,
            exchange.method,
            exchange.path,
            exchange.route,
            status,
            exchange.started,
            first_byte,
            exchange.answer,
            body_bytes,
            exchange.span,
        )


def outcome_of(status: int) -> str:
    if status == 499:
        return "client_gone"
    if status == 504:
        return "timeout"
    return "error" if status >= 500 else "completed"


@dataclass
class Completion:
    metrics: FrontendMetrics
    request_id: str
    method: str
    path: str
    route: str
    status: int
    started: float  # time.monotonic() at the request's arrival
    first_byte: float  # seconds to the status line
    answer: Answer | None
    body_bytes: int | None  # a whole body's length (a stream's is counted in ``answer``)
    span: Any = None

    def __call__(self) -> None:
        duration = time.monotonic() - self.started
        answer = self.answer or Answer()
        outcome = answer.outcome if answer.streamed and answer.outcome else outcome_of(self.status)
        sent = answer.bytes if answer.streamed else (self.body_bytes or 0)
        self.metrics.duration.labels(self.route).observe(duration)
        if answer.streamed:
            self.metrics.stream_duration.labels(self.route).observe(max(duration - self.first_byte, 0.0))
        if answer.queue_wait is not None:
            self.metrics.queue_wait.observe(max(answer.queue_wait, 0.0))
        fields = {
            "method": self.method,
            "path": self.path,
            "route": self.route,
            "status": self.status,
            "outcome": outcome,
            "duration_ms": round(duration * 1000, 1),
            "first_byte_ms": round(self.first_byte * 1000, 1),
            "bytes": sent,
            "streamed": answer.streamed,
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.completion_tokens,
        }
        tokens = ""
        if answer.prompt_tokens is not None or answer.completion_tokens is not None:
            tokens = f", tokens in {_count(answer.prompt_tokens)} out {_count(answer.completion_tokens)}"
        token = request_id_var.set(self.request_id)  # the request's own context has been torn down
        try:
            log.info(
                "%s %s -> %s %s in %.1f ms (first byte %.1f ms, %d bytes%s)",
                self.method,
                self.path,
                self.status,
                outcome,
                duration * 1000,
                self.first_byte * 1000,
                sent,
                tokens,
                extra={"fields": fields},
            )
        finally:
            request_id_var.reset(token)
        if self.span is not None:
            self._end_span(fields)

    def _end_span(self, fields: dict[str, Any]) -> None:
        span = self.span
        span.set_attribute("http.response.status_code", self.status)
        span.set_attribute("sagelmi.outcome", fields["outcome"])
        span.set_attribute("sagelmi.bytes", fields["bytes"])
        if fields["prompt_tokens"] is not None:
            span.set_attribute("gen_ai.usage.input_tokens", fields["prompt_tokens"])
        if fields["completion_tokens"] is not None:
            span.set_attribute("gen_ai.usage.output_tokens", fields["completion_tokens"])
        span.end()


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)
