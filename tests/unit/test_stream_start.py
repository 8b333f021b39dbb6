"""An OpenAI stream of the vLLM handler goes to the worker once the engine has its request
(``started`` in handlers/engines/vllm_observe.py): the worker sends the head as soon as the
handler returns, and the frontend's work for the head then runs after the engine took the
request, not before it. Here the engine is a stand-in with ``AsyncLLM``'s two ways in, so that
``add_request`` can be held; tests/e2e/test_vllm_openai.py streams through vLLM itself."""

import asyncio

import pytest

from handlers.engines.vllm_observe import Observed, started


class Engine:
    """``generate`` calls ``add_request`` through the instance, as vLLM's does; ``add_request``
    waits for ``admit``. What ``generate`` saw end early is in ``aborted``."""

    def __init__(self, items: list[str]) -> None:
        self.items = items
        self.admit = asyncio.Event()
        self.added: list[str] = []
        self.aborted: list[str] = []

    async def add_request(self, request_id: str, prompt: str, params: object) -> None:
        await self.admit.wait()
        self.added.append(request_id)

    async def generate(self, prompt: str, params: object, request_id: str):
        try:
            await self.add_request(request_id, prompt, params)
            for item in self.items:
                await asyncio.sleep(0)
                yield item
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise


class ObservedEngine(Observed, Engine):
    """The stand-in observed as vLLM's engine is (``ObservedAsyncLLM``)."""


async def sse(engine: Engine, request_id: str = "r1"):
    """A serving class's stream: nothing happens until its first item is asked for."""
    async for item in engine.generate("prompt", None, request_id):
        yield f"data: {item}\n\n"
    yield "data: [DONE]\n\n"


async def drain(stream) -> list[str]:
    return [item async for item in stream]


def test_the_stream_is_handed_over_once_the_engine_has_its_request():
    async def scenario():
        engine = ObservedEngine(["a", "b"])
        handing = asyncio.ensure_future(started(sse(engine)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not handing.done() and engine.added == []  # held in add_request: not handed over yet
        engine.admit.set()
        stream = await asyncio.wait_for(handing, 5)
        assert engine.added == ["r1"]
        assert await drain(stream) == ["data: a\n\n", "data: b\n\n", "data: [DONE]\n\n"]

    asyncio.run(scenario())


def test_a_stream_that_ends_or_fails_before_the_engine_is_handed_over_as_it_is():
    async def empty():
        return
        yield  # an async generator with no items

    async def failing():
        raise ValueError("the prompt is too long")
        yield

    async def scenario():
        assert await drain(await asyncio.wait_for(started(empty()), 5)) == []
        stream = await asyncio.wait_for(started(failing()), 5)
        with pytest.raises(ValueError, match="too long"):
            await drain(stream)

    asyncio.run(scenario())


def test_a_request_cancelled_while_its_stream_starts_cancels_the_engine_request():
    async def scenario():
        engine = ObservedEngine(["a"])
        handing = asyncio.ensure_future(started(sse(engine)))
        for _ in range(5):
            await asyncio.sleep(0)
        handing.cancel()  # the frontend's Cancel: the worker cancels the request's task
        with pytest.raises(asyncio.CancelledError):
            await handing
        for _ in range(5):
            await asyncio.sleep(0)
        assert engine.aborted == ["r1"] and engine.added == []

    asyncio.run(scenario())


def test_the_engines_stream_is_not_wrapped_in_a_generator_of_ours_when_nothing_counts_it():
    async def scenario():
        engine = ObservedEngine(["a"])
        inner = Engine.generate.__get__(engine)  # the engine's own, below Observed
        engine.admit.set()
        stream = engine.generate("prompt", None, "r1")  # no request usage here: a warm-up's call
        assert stream.ag_code is inner("prompt", None, "r1").ag_code  # vLLM's generator itself
        assert await drain(stream) == ["a"]

    asyncio.run(scenario())


def test_prepend_puts_an_item_taken_before_the_rest_and_passes_the_rests_end_on():
    from handlers.api import prepend

    async def rest():
        yield 2
        raise ValueError("the stream failed")

    async def scenario():
        stream = prepend(1, rest())
        assert await anext(stream) == 1
        assert await anext(stream) == 2
        with pytest.raises(ValueError, match="the stream failed"):
            await anext(stream)
        assert await drain(prepend("only", drain_empty())) == ["only"]

    async def drain_empty():
        return
        yield

    asyncio.run(scenario())
