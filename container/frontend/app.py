"""The Flask app: SageMaker's ``/ping``, ``/metrics``, LMI's management routes and the
documents. The handler's routes are served before it (``container/frontend/early.py``: rank 0
answers them), and reach it only for a method they do not answer (405, ``OPTIONS``, ``HEAD``) or
a request whose head rank 0 does not read (400).
"""

from __future__ import annotations

import functools
import json
import logging

import msgspec
from flask import Flask, Response, g, request
from prometheus_client import CONTENT_TYPE_LATEST
from werkzeug.exceptions import HTTPException

from container.core.artifacts import download_root
from container.core.errors import (
    InputError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ServingError,
    describe,
    error_body,
)
from container.core.launch import FrontendLaunch, ModelInfo
from container.core.logs import request_id_var
from container.core.protocol import WorkerState
from container.core.tracing import make_tracer
from container.frontend import openapi
from container.frontend.adapters import AdapterRegistry
from container.frontend.completion import INFERENCE_ID, RequestLog
from container.frontend.early import ROUTES, EarlyRequests, count_refusal
from container.frontend.management import add_management_routes
from container.frontend.metrics import FrontendMetrics
from container.frontend.router import Router

log = logging.getLogger("sagelmi.frontend")

UNLOGGED = ("/ping", "/metrics")  # health checks and scrapes: no completion line, no span


def _error_response(exc: BaseException) -> Response:
    """The error in the envelope of the route the client called."""
    return Response(error_body(request.path, exc), status=describe(exc)[0], mimetype="application/json")


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
    app.extensions["sagelmi.metrics"] = metrics  # the server's main loop counts the connections it closes
    tracer = make_tracer(launch.traces_exporter, "frontend")
    app.extensions["sagelmi.tracer"] = tracer  # shut down (spans flushed) when the frontend drains

    requests = RequestLog(metrics, tracer)
    handler_routes_text = ", ".join(f"{method} {path}" for path, method in ROUTES.items())

    @app.before_request
    def _start() -> None:
        route = request.url_rule.rule if request.url_rule else "unmatched"
        g.exchange = requests.begin(request.headers, request.method, request.path, route, request.path not in UNLOGGED)

    @app.after_request
    def _finish(resp: Response) -> Response:
        if request.path not in UNLOGGED:
            resp.headers[INFERENCE_ID] = g.exchange.request_id
            body_bytes = None if resp.is_streamed else resp.calculate_content_length()  # (a stream would be read whole)
            resp.call_on_close(requests.finish(g.exchange, resp.status_code, body_bytes))
        return resp

    @app.teardown_request
    def _forget(_exc) -> None:
        request_id_var.set("-")

    @app.errorhandler(ServingError)
    def _serving_error(exc: ServingError) -> Response:
        count_refusal(metrics, exc)
        return _error_response(exc)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        by_code: dict[int | None, ServingError] = {
            404: NotFound(
                f"no route {request.method} {request.path}; the server answers GET /ping, {handler_routes_text}, "
                f"GET /models, /models/{{model}}/adapters, POST /adapters, DELETE /adapters/{{name}}, GET /openapi.json"
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
    def openapi_text() -> str:  # 600 KB of JSON: rendered at the first request, then reused
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

    # The handler's routes, served before Flask sees them (the main loop hands them to rank 0);
    # Flask knows them for what they do not answer: a wrong method (405), OPTIONS, HEAD of GET
    # /v1/models, and a head rank 0 does not read
    early = EarlyRequests(router, launch, requests)
    app.extensions["sagelmi.early"] = early

    def invocations() -> Response:
        raise InputError(
            f"{request.environ.get('SERVER_PROTOCOL', 'this HTTP version')} request heads like this one are not "
            "read on the model's routes: send HTTP/1.1 (or 1.0) with a body by Content-Length or chunked"
        )

    for path, method in ROUTES.items():
        app.add_url_rule(path, "invocations", invocations, methods=[method])

    add_management_routes(app, router, registry, launch)
    return app
