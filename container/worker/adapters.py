"""The worker's side of LoRA adapter management.

The frontend keeps the registry (``container.frontend.adapters``); a group only
applies what it is sent. ``AdapterTable`` remembers every registration it got,
so that one that arrives while the model is still loading (the frontend sends
the whole registry on every new connection, and a restarted group is connected
to while it loads) is applied right after the load, before the group says it is
ready. Each message is answered ``End`` (done) or ``Fail`` (why not) with its id.

Ordering: the handler's ``add_adapter`` records the name before its first
``await``, and the task that runs it is created before the task of any request
that comes after the registration on the same connection (asyncio runs tasks
in creation order), so such a request already finds the adapter.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from container.core.errors import InputError, describe
from container.core.protocol import End, Fail, SetAdapter

log = logging.getLogger("sagelmi.worker.adapters")


class AdapterTable:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.paths: dict[str, str] = {}  # name -> local directory, in registration order
        self.loaded_yet = False  # set once the handler is loaded (then registrations apply at once)
        self.engine: Any = None  # the built-in engine (handlers.api.engine.Engine), if one serves
        self.origin = "handler"

    def receive(self, conn: Any, message: SetAdapter) -> None:
        """Record ``message`` and, once the handler is loaded, apply it (in a task)."""
        if message.path is not None:
            self.paths[message.name] = message.path
        else:
            self.paths.pop(message.name, None)
        if not self.loaded_yet:
            self.loop.create_task(conn.send(End(id=message.id)))  # applied after the load
            return
        self.loop.create_task(self._apply(conn, message))

    async def _apply(self, conn: Any, message: SetAdapter) -> None:
        try:
            await self._call(message)
        except Exception as exc:
            status, summary, detail = describe(exc)
            log.warning("adapter %s: %s", message.name, detail)
            await _send(conn, Fail(id=message.id, code=status, message=summary, error=detail))
            return
        await _send(conn, End(id=message.id))

    async def _call(self, message: SetAdapter) -> None:
        if self.engine is None or not self.engine.serves_adapters:
            raise InputError(f"the handler {self.origin} does not serve LoRA adapters")
        if message.path is not None:
            await self.engine.add_adapter(message.name, message.path)
            log.info("adapter %s registered", message.name)
        else:
            await self.engine.remove_adapter(message.name)
            log.info("adapter %s unregistered", message.name)

    async def loaded(self, engine: Any, origin: str) -> None:
        """The handler is loaded (``engine``: the built-in engine serving, or None for a
        ``model.py``): apply every registration received so far. A failing one is logged and
        dropped (the frontend checked it before)."""
        self.loaded_yet, self.engine, self.origin = True, engine, origin
        if engine is None or not engine.serves_adapters:
            if self.paths:
                log.error("the handler %s does not serve LoRA adapters; ignoring %s", origin, ", ".join(self.paths))
            return
        for name, path in list(self.paths.items()):
            try:
                await engine.add_adapter(name, path)
                log.info("adapter %s registered", name)
            except Exception as exc:
                log.error("adapter %s could not be loaded: %s", name, describe(exc)[2])
                self.paths.pop(name, None)


async def _send(conn: Any, message: End | Fail) -> None:
    try:
        await conn.send(message)
    except Exception:  # the frontend went away: it replays the registry when it reconnects
        pass
