"""``/metrics``: the frontend's own Prometheus metrics, plus every worker
group's (including the engine's, e.g. vLLM's), each group's samples labelled
with its ``group`` (and, in MPI mode, each rank's with its ``rank``).
docs/observability.md lists them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from container.core.metrics_text import merge

_LONG = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sagelmi_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.first_byte = Histogram(
            "sagelmi_request_first_byte_seconds",
            "Time from receiving a request to sending its status line",
            ["route"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.duration = Histogram(
            "sagelmi_request_duration_seconds",
            "Time from receiving a request to the end of its answer (its last byte handed to the connection)",
            ["route"],
            registry=self.registry,
            buckets=_LONG,
        )
        self.stream_duration = Histogram(
            "sagelmi_stream_duration_seconds",
            "Time from a streamed answer's status line to its end",
            ["route"],
            registry=self.registry,
            buckets=_LONG,
        )
        self.queue_wait = Histogram(
            "sagelmi_request_queue_seconds",
            "Time from admitting a request to its handler call beginning in the worker group",
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.queue_full = Counter(
            "sagelmi_requests_refused_queue_full",
            "Requests refused with 503 because job_queue_size requests were in flight",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "sagelmi_requests_in_flight", "Requests admitted and not yet finished", registry=self.registry
        )
        self.poison_refused = Counter(
            "sagelmi_poison_requests_refused",
            "Copies of requests refused because the same request was in flight at two deaths of worker groups",
            registry=self.registry,
        )
        self.read_early = Counter(
            "sagelmi_requests_read_early",
            "Requests read and answered by their worker group's rank 0, handed the connection by the frontend's "
            "accepting thread, without a request thread",
            registry=self.registry,
        )
        self.connections_closed = Counter(
            "sagelmi_connections_closed",
            "Connections the frontend closed while they waited for a request: reason head (its head was not "
            "whole within header_read_timeout), client (past max_connections_per_client from one address) or "
            "server (at the frontend's bound on connections)",
            ["reason"],
            registry=self.registry,
        )
        self.worker_ready = Gauge(
            "sagelmi_worker_ready", "1 when the worker group is ready", ["group"], registry=self.registry
        )

    def render(self, group_texts: dict[str, str]) -> bytes:
        """The frontend's metrics followed by the groups', merged per family."""
        return generate_latest(self.registry) + merge(group_texts, "group")
