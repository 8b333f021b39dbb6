"""Prometheus text from several processes, merged into one exposition with a
label telling them apart (``group`` in the frontend, ``rank`` in an MPI group)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    """A collector that yields pre-built metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


def merge(texts: dict[str, str], label: str) -> bytes:
    """One exposition of every family in ``texts`` (by ``label`` value), each
    sample labelled ``label``; samples that already carry it keep theirs."""
    merged: dict[str, Metric] = {}
    for value, text in texts.items():
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {label: value, **sample.labels}
                target.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
    registry = CollectorRegistry()
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
