"""OpenTelemetry tracing, opt-in by OpenTelemetry's own variables.

Tracing is on when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp`` or
``console``), or, without it, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (then ``otlp``); ``none`` or
``OTEL_SDK_DISABLED=true`` turn it off. ``exporter_from`` decides once, when the
settings are resolved (``Settings.traces_exporter``), and the OTLP exporter's
protocol with it: ``http/protobuf`` unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
(or ``OTEL_EXPORTER_OTLP_PROTOCOL``) says ``grpc``. The exporters, the batch span
processor and the sampler read the rest of the ``OTEL_*`` variables themselves
(endpoint, headers, ``OTEL_SERVICE_NAME``, ``OTEL_BSP_SCHEDULE_DELAY`` ...).

Nothing here imports OpenTelemetry until a ``Tracer`` is made: with tracing off,
the request path costs one ``is None`` test.

A ``Tracer`` keeps its own provider rather than OpenTelemetry's global one (vLLM
sets the global one in the worker when its own tracing is on). The parent of a
request's first span comes from the incoming W3C ``traceparent``/``tracestate``
headers, else from AWS X-Ray's ``X-Amzn-Trace-Id`` (``Root=1-<8 hex>-<24 hex>;
Parent=<16 hex>;Sampled=0|1``: the same trace id, as X-Ray's propagator reads it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
XRAY_HEADER = "X-Amzn-Trace-Id"
EXPORTERS = ("none", "otlp-http", "otlp-grpc", "console")
DEFAULT_SERVICE_NAME = "sagelmi"


def exporter_from(env: Mapping[str, str]) -> str:
    """The span exporter the ``OTEL_*`` variables of ``env`` ask for: ``none`` (off),
    ``console``, ``otlp-http`` or ``otlp-grpc``. The first of a list is used; the
    caller checks the answer against ``EXPORTERS`` (``zipkin`` is not one)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return "none"
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower().split(",")[0].strip()
    if not named:
        otlp = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        named = "otlp" if otlp else "none"
    if named != "otlp":
        return named
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = protocol or "http/protobuf"
    return {"grpc": "otlp-grpc", "http/protobuf": "otlp-http"}.get(protocol.strip(), f"otlp over {protocol}")


class Headers(Protocol):
    """A request's headers: a ``dict`` (request properties) or Werkzeug's ``Headers``."""

    def get(self, key: str) -> str | None: ...

    def items(self) -> Iterable[tuple[str, str]]: ...


def header(headers: Headers, name: str) -> str | None:
    """``headers[name]``, whatever the case of its spelling (request properties keep the client's)."""
    value = headers.get(name)
    if value is not None:
        return value
    lower = name.lower()
    return next((v for k, v in headers.items() if k.lower() == lower), None)


def xray_parts(value: str) -> tuple[str, str | None, bool]:
    """``X-Amzn-Trace-Id``'s trace id (32 hex digits), parent span id and sampled flag;
    raises ``ValueError`` for a header without a valid ``Root``."""
    fields = dict(part.strip().partition("=")[::2] for part in value.split(";") if "=" in part)
    version, _, rest = fields.get("Root", "").partition("-")
    epoch, _, unique = rest.partition("-")
    trace_id = epoch + unique
    if version != "1" or len(epoch) != 8 or len(unique) != 24:
        raise ValueError(f"not an X-Ray trace header: {value!r}")
    int(trace_id, 16)
    parent = fields.get("Parent")
    if parent is not None and (len(parent) != 16 or not all(c in "0123456789abcdefABCDEF" for c in parent)):
        parent = None
    return trace_id.lower(), parent, fields.get("Sampled", "1") != "0"


class Tracer:
    """Spans of one process (``component``: ``frontend``, ``worker-0`` ...), exported
    by ``exporter`` (one of ``EXPORTERS`` but ``none``) from a background thread."""

    def __init__(self, exporter: str, component: str) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"sagelmi.component": component})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(exporter)))
        self._tracer = self._provider.get_tracer("sagelmi")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()

    def start(self, name: str, headers: Headers, attributes: dict[str, Any], server: bool = False) -> Any:
        """Start a span whose parent the request's ``headers`` name (none: a new trace);
        the caller ends it (``span.end()``)."""
        kind = self._trace.SpanKind.SERVER if server else self._trace.SpanKind.INTERNAL
        return self._tracer.start_span(name, context=self._parent(headers), kind=kind, attributes=attributes)

    def headers_of(self, span: Any) -> dict[str, str]:
        """The W3C headers that make ``span`` the parent of the next hop's spans."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier

    def shutdown(self) -> None:
        """Export what is left (the batch processor's queue) and stop."""
        self._provider.shutdown()

    def _parent(self, headers: Headers) -> Any:
        traceparent = header(headers, TRACEPARENT)
        if traceparent:
            carrier = {TRACEPARENT: traceparent}
            if (state := header(headers, TRACESTATE)) is not None:
                carrier[TRACESTATE] = state
            return self._propagator.extract(carrier)
        xray = header(headers, XRAY_HEADER)
        if not xray:
            return None
        try:
            trace_id, parent, sampled = xray_parts(xray)
        except ValueError:
            return None
        if parent is None:  # a trace without a span to hang from: its spans start a trace of their own
            return None
        flags = self._trace.TraceFlags(self._trace.TraceFlags.SAMPLED if sampled else 0)
        remote = self._trace.SpanContext(int(trace_id, 16), int(parent, 16), is_remote=True, trace_flags=flags)
        return self._trace.set_span_in_context(self._trace.NonRecordingSpan(remote))


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name == "otlp-grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def make_tracer(exporter: str, component: str) -> Tracer | None:
    """A ``Tracer`` when tracing is on (``exporter`` is not ``none``), else ``None``."""
    return None if exporter == "none" else Tracer(exporter, component)
