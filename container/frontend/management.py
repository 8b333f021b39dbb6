"""LMI's management routes for the one served model and its LoRA adapters, and the adapter
routes of AWS's vLLM container (its ``model-hosting-container-standards``), on the same registry.

GET    /models                                the model, its worker groups and their state
GET    /models/{model}/adapters               registered adapters
POST   /models/{model}/adapters?name=&src=    register one (src: a directory or an s3:// prefix)
GET    /models/{model}/adapters/{name}        describe one
DELETE /models/{model}/adapters/{name}        unregister one
POST   /adapters  {"name", "src"}             register one (AWS's vLLM container; the query's name
                                              and src when there is no body, as there)
DELETE /adapters/{adapter_name}               unregister one (AWS's vLLM container)

AWS's routes answer as that container does: ``Adapter <name> registered`` / ``unregistered`` as
text, naming the ``X-Amzn-SageMaker-Adapter-Alias`` header's alias when the request has one.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Flask, Request, Response, request

from container.core.errors import InputError, InvalidJSON, NotFound, scrub
from container.core.launch import FrontendLaunch, ModelInfo
from container.frontend.adapters import Adapter, AdapterRegistry
from container.frontend.router import Router


def _json(body, status: int = 200) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json")


def _card(adapter: Adapter) -> dict:
    return {"name": adapter.name, "src": adapter.src}


ALIAS_HEADER = "X-Amzn-SageMaker-Adapter-Alias"  # the name AWS's adapter routes answer with, when given


def _text(text: str) -> Response:
    return Response(text, mimetype="text/plain")


def sagemaker_registration(req: Request) -> tuple[str, str]:
    """The ``name`` and ``src`` of a ``POST /adapters``: its JSON object, or without a body its query
    (as AWS's container reads them; its ``preload`` and ``pin`` and any other field are not used:
    an adapter is loaded when it is registered). Raises ``InputError`` for a body that is not a JSON
    object or a name or src that is missing or not a string, before anything else is done."""
    data = req.get_data()
    fields: Any = req.args
    if data.strip():
        try:
            fields = json.loads(data)
        except json.JSONDecodeError as exc:
            raise InvalidJSON(exc) from None
        except UnicodeDecodeError:
            raise InputError("request body is not valid JSON: it is not UTF-8, UTF-16 or UTF-32 text") from None
        if not isinstance(fields, dict):
            raise InputError('the body must be a JSON object: {"name": <adapter name>, "src": <directory or s3://...>}')
    name, src = fields.get("name"), fields.get("src")
    for field, value in (("name", name), ("src", src)):
        if not isinstance(value, str) or not value:
            what = "the adapter's name" if field == "name" else "a directory or an s3:// prefix"
            raise InputError(f"'{field}' must be a non-empty string ({what}); got {value!r}"[:300])
    return name, src


def add_management_routes(app: Flask, router: Router, registry: AdapterRegistry, launch: FrontendLaunch) -> None:
    def served() -> ModelInfo:
        # The supervisor's launch names the model; a frontend started without one (a test's) fails these routes
        assert launch.model is not None, "the frontend's launch names no model"
        return launch.model

    def check_model(name: str) -> None:
        model = served()
        if name != model.name:
            raise NotFound(f"model {name!r} is not served here; this server serves {model.name!r} (GET /models)")

    @app.get("/models")
    def list_models() -> Response:
        groups = [
            {"index": g.index, "state": c.state.value, "detail": scrub(c.detail), "devices": g.devices}
            for c, g in zip(router.groups, launch.groups)
        ]
        healthy, _ = router.health()
        model = served()
        return _json(
            {
                "models": [
                    {
                        "modelName": model.name,
                        "modelUrl": model.url,
                        "status": "READY" if healthy else "UNAVAILABLE",
                        "workerGroups": groups,
                        "adapters": [a.name for a in registry.list()],
                    }
                ]
            }
        )

    @app.get("/models/<name>/adapters")
    def list_adapters(name: str) -> Response:
        check_model(name)
        return _json({"adapters": [_card(a) for a in registry.list()]})

    @app.post("/models/<name>/adapters")
    def register_adapter(name: str) -> Response:
        check_model(name)
        adapter = registry.register(request.args.get("name", ""), request.args.get("src", ""))
        return _json({"status": f"Adapter {adapter.name} registered"})

    @app.get("/models/<name>/adapters/<adapter>")
    def describe_adapter(name: str, adapter: str) -> Response:
        check_model(name)
        return _json([_card(registry.get(adapter))])

    @app.delete("/models/<name>/adapters/<adapter>")
    def unregister_adapter(name: str, adapter: str) -> Response:
        check_model(name)
        registry.unregister(adapter)
        return _json({"status": f"Adapter {adapter} unregistered"})

    @app.post("/adapters")
    def register_sagemaker_adapter() -> Response:
        adapter = registry.register(*sagemaker_registration(request))
        return _text(f"Adapter {request.headers.get(ALIAS_HEADER) or adapter.name} registered")

    @app.delete("/adapters/<adapter_name>")
    def unregister_sagemaker_adapter(adapter_name: str) -> Response:
        registry.unregister(adapter_name)
        return _text(f"Adapter {request.headers.get(ALIAS_HEADER) or adapter_name} unregistered")
