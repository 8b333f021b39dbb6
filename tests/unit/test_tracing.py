"""Which OTEL_* variables turn tracing on, and reading X-Ray's trace header."""

import pytest

from container.core.settings import SettingsError, resolve_settings
from container.core.tracing import exporter_from, header, xray_parts


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "none"),
    ({"OTEL_SERVICE_NAME": "x"}, "none"),  # naming the service alone does not trace
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "otlp-http"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "otlp-grpc"),
    ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, "otlp-http"),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "none"),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, "none"),
])
def test_the_otel_variables_choose_the_exporter(env, expected, tmp_path):
    assert exporter_from(env) == expected
    assert resolve_settings(env, tmp_path).traces_exporter == expected


@pytest.mark.parametrize("env", [{"OTEL_TRACES_EXPORTER": "zipkin"},
                                 {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}])
def test_an_exporter_sagelmi_lacks_stops_start_up_naming_it(env, tmp_path):
    with pytest.raises(SettingsError, match="span exporter"):
        resolve_settings(env, tmp_path)


def test_xray_header_gives_the_trace_parent_and_sampling():
    assert xray_parts("Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1") == (
        "5759e988bd862e3fe1be46a994272793", "53995c3f42cd8ad8", True)
    assert xray_parts("Root=1-5759e988-bd862e3fe1be46a994272793;Sampled=0") == (
        "5759e988bd862e3fe1be46a994272793", None, False)
    with pytest.raises(ValueError):
        xray_parts("Root=2-nothex")


def test_headers_are_found_whatever_their_case():
    assert header({"TraceParent": "00-x"}, "traceparent") == "00-x"
    assert header({"a": "b"}, "traceparent") is None
