"""LMI's management routes for the one served model and its LoRA adapters.

GET    /models                                the model, its worker groups and their state
GET    /models/{model}/adapters               registered adapters
POST   /models/{model}/adapters?name=&src=    register one (src: a directory or an s3:// prefix)
GET    /models/{model}/adapters/{name}        describe one
DELETE /models/{model}/adapters/{name}        unregister one
"""

from __future__ import annotations

import json

from flask import Flask, Response, request

from container.core.errors import NotFound, scrub
from container.core.launch import FrontendLaunch, ModelInfo
from container.frontend.adapters import Adapter, AdapterRegistry
from container.frontend.router import Router


def _json(body, status: int = 200) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json")


def _card(adapter: Adapter) -> dict:
    return {"name": adapter.name, "src": adapter.src}


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
