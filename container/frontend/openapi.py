"""``GET /openapi.json``: every route, its request schema and its error envelopes.

The schemas are generated from the types the server validates with: LMI's
``LmiBody``/``LmiParameters`` (``handlers/engines/lmi_schema.py``), vLLM's own
``ChatCompletionRequest``/``CompletionRequest`` (the built-in handler validates
``/v1`` bodies with them) and the error envelopes ``LmiError``/``OpenAIError``
(``container/core/errors.py``). vLLM takes seconds to import, and the frontend does
not import it, so the document is generated ahead (``sagelmi openapi --write``)
into ``container/frontend/openapi.json``; a unit test compares the file with what the
installed types generate, so a vLLM upgrade that changes them fails until the
file is regenerated.

With a ``model.py`` the handler decides what ``/invocations`` and the ``/v1``
routes accept and answer: ``for_model`` then leaves their bodies open (any
content) and keeps the error envelopes, which the server writes whatever the
handler.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

DOCUMENT_FILE = Path(__file__).with_name("openapi.json")


@lru_cache(maxsize=1)
def _packaged() -> dict[str, Any]:
    return json.loads(DOCUMENT_FILE.read_text())


def for_model(builtin_schemas: bool) -> dict[str, Any]:
    """The document the server gives: the built-in engine's, or with a ``model.py``
    its handler routes' bodies left open (errors stay documented)."""
    document = _packaged()
    if builtin_schemas:
        return document
    document = copy.deepcopy(document)
    for path in document["x-handler-routes"]:
        for operation in document["paths"][path].values():
            if "requestBody" in operation:
                operation["requestBody"] = {"required": False, "content": {"*/*": {"schema": {}}}}
            operation["responses"]["200"] = {"description": "what the handler answers"}
            operation["responses"]["default"] = {"description": "a status the handler chose"}
            operation["summary"] += " (answered by the model's handler: model.py decides the body)"
    return document
