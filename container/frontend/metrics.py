"""``/metrics``: the frontend's own Prometheus metrics, plus every worker's
(including the engine's, e.g. vLLM's), each worker's samples labelled with its
``group``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    """A collector that yields pre-built metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("sagelmi_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.first_byte = Histogram("sagelmi_request_first_byte_seconds",
                                    "Time from receiving a request to sending its status line",
                                    ["route"], registry=self.registry,
                                    buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
        self.in_flight = Gauge("sagelmi_requests_in_flight", "Requests admitted and not yet finished",
                               registry=self.registry)
        self.worker_ready = Gauge("sagelmi_worker_ready", "1 when the worker group is ready",
                                  ["group"], registry=self.registry)

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.first_byte.labels(route).observe(seconds)

    def render(self, worker_texts: dict[str, str]) -> bytes:
        """The frontend's metrics followed by the workers', merged per family."""
        merged: dict[str, Metric] = {}
        for group, text in worker_texts.items():
            for family in text_string_to_metric_families(text):
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    target.add_sample(sample.name, {**sample.labels, "group": group}, sample.value,
                                      sample.timestamp, sample.exemplar)
        workers = CollectorRegistry()
        workers.register(_Families(list(merged.values())))
        return generate_latest(self.registry) + generate_latest(workers)
