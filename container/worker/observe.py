"""What the worker records about each request it serves: when its handler call
began (``Head.started``: the frontend's queue-wait metric), the tokens the handler
counted (``handlers.api.usage``: sent with the ``End``), and, with tracing on, a
span around the handler call, a child of the frontend's span (whose
``traceparent`` the request's properties carry). And the group's Prometheus text
(``metrics_text``), which the frontend's ``/metrics`` asks rank 0 for."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import generate_latest

from container.core.metrics_text import merge
from container.core.protocol import METRICS_PATH, Invoke
from container.core.tracing import make_tracer
from handlers.api.usage import RequestUsage, current_usage

if TYPE_CHECKING:
    from container.worker.ranks import Leader

METRICS_TIMEOUT = 2.0  # how long rank 0 waits for the other ranks' metrics


async def metrics_text(leader: Leader | None) -> bytes:
    """This process's Prometheus text; in MPI mode (rank 0, ``leader``) every rank's, labelled ``rank``."""
    own = generate_latest()
    if leader is None:
        return own
    ranks = await asyncio.to_thread(leader.collect_metrics, METRICS_TIMEOUT)
    texts = {str(rank): text for rank, text in ranks.items()}
    return merge({"0": own.decode(), **texts}, "rank")


class Observation:
    """One request in the worker."""

    def __init__(self, span: Any = None) -> None:
        self.usage = RequestUsage()
        self.started = 0.0
        self.span = span
        self.outcome = "completed"

    def call_started(self) -> None:
        self.started = time.monotonic()


class Observer:
    def __init__(self, traces_exporter: str, component: str) -> None:
        self.tracer = make_tracer(traces_exporter, component)

    def begin(self, message: Invoke) -> Observation:
        """Observe ``message``'s request; call in the request's own context (its task)."""
        if self.tracer is None or message.path == METRICS_PATH:
            seen = Observation()
        else:
            request_id = message.properties.get("requestId", message.id)
            attributes = {"sagelmi.request_id": request_id, "url.path": message.path}
            seen = Observation(self.tracer.start("sagelmi.handler", message.properties, attributes))
            seen.usage.trace_headers = self.tracer.headers_of(seen.span)
        current_usage.set(seen.usage)
        return seen

    def end(self, seen: Observation, stopped: bool) -> None:
        """The request's answer has been sent, or ``stopped`` (cancelled, failed)."""
        if seen.span is None:
            return
        if stopped and seen.outcome == "completed":
            seen.outcome = "cancelled"
        usage = seen.usage
        if usage.prompt_tokens is not None:
            seen.span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
        if usage.completion_tokens is not None:
            seen.span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        seen.span.set_attribute("sagelmi.outcome", seen.outcome)
        seen.span.end()

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.shutdown()
