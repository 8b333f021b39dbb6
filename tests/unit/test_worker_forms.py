"""Form bodies in the worker: refused by the built-in engines (415) and past max_multipart_parts (400)
before anything parses them; parsed off the worker's loop for the handlers that read them."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from urllib3 import encode_multipart_formdata

from container.core.errors import InputError, UnsupportedMediaType, describe
from container.core.protocol import Invoke
from container.core.settings import Settings
from container.worker.calls import Calls
from container.worker.requests import Inputs, request_input
from handlers.api.engine import Engine
from handlers.engines.accelerate import AccelerateEngine

BUILTIN = Inputs(forms=False)
MODEL_PY = Inputs(forms=True, max_parts=1000)


def invoke(body: bytes, content_type: str, query: str = "") -> Invoke:
    return Invoke(id="1", properties={"Content-Type": content_type}, body=body, path="/invocations", query=query)


def multipart(parts: int) -> Invoke:
    body, content_type = encode_multipart_formdata([(f"f{i}", "x") for i in range(parts)])
    return invoke(body, content_type)


def test_the_built_in_engines_read_no_forms_and_a_model_py_does():
    settings = Settings(max_multipart_parts=7)
    assert not Engine.reads_forms and not AccelerateEngine.reads_forms  # every built-in engine: the base
    assert not Inputs.for_handler(settings, 1, AccelerateEngine).forms
    model_py = Inputs.for_handler(settings, 1, None)
    assert model_py.forms and model_py.max_parts == 7 and model_py.common["device_id"] == "-1"


def test_a_built_in_engine_refuses_multipart_with_415_without_reading_the_body():
    for message in (multipart(3), invoke(b"not a multipart body at all", "multipart/form-data; boundary=zz"),
                    invoke(b"", "Multipart/Form-Data")):
        refused = BUILTIN.refusal(message)
        assert isinstance(refused, UnsupportedMediaType)
        status, _, detail = describe(refused)
        assert status == 415 and "multipart/form-data" in detail and "application/json" in detail


def test_a_built_in_engine_gets_a_url_encoded_body_whole():
    """curl -d labels JSON as a form; the engine reads JSON, so nothing is parsed as a form."""
    message = invoke(b'{"inputs": "a=b&c=d"}', "application/x-www-form-urlencoded", query="x=1")
    assert BUILTIN.refusal(message) is None
    build, parse = BUILTIN.of(message)
    inputs = build()
    assert not parse
    assert inputs.content.get_keys() == ["x", "data"] and inputs.get_as_json() == {"inputs": "a=b&c=d"}


def test_a_handler_gets_up_to_max_multipart_parts_as_fields():
    message = multipart(1000)
    assert MODEL_PY.refusal(message) is None
    build, parse = MODEL_PY.of(message)
    inputs = build()
    assert parse and inputs.content.size() == 1000 and inputs.get_as_string(key="f999") == "x"
    assert MODEL_PY.of(invoke(b"a=1", "application/x-www-form-urlencoded"))[1]  # a url-encoded form too
    assert not MODEL_PY.of(invoke(b"{}", "application/json"))[1]


def test_more_parts_are_400_naming_the_setting_counted_without_parsing():
    message = multipart(60_000)
    started = time.perf_counter()
    refused = MODEL_PY.refusal(message)
    elapsed = time.perf_counter() - started
    assert isinstance(refused, InputError)
    assert "has 60000 parts" in str(refused) and "at most 1000" in str(refused)
    assert "max_multipart_parts" in str(refused) and "SERVING_MAX_MULTIPART_PARTS" in str(refused)
    assert elapsed < 0.5, f"counting 60,000 parts took {elapsed:.2f}s"  # the email parser takes 14 s


def test_a_body_without_a_boundary_is_left_to_the_parse_to_refuse():
    message = invoke(b"whatever", "multipart/form-data")
    assert MODEL_PY.refusal(message) is None
    with pytest.raises(InputError, match="boundary"):
        request_input(message, MODEL_PY)


class Builds:
    """Records the thread that built each Input."""

    def __init__(self) -> None:
        self.on: list[str] = []

    def of(self, message: Invoke):
        build, parse = MODEL_PY.of(message)

        def recorded():
            self.on.append(threading.current_thread().name)
            return build()
        return recorded, parse


@pytest.mark.parametrize("kind", ["async", "async_generator"])
def test_an_async_handler_gets_its_form_parsed_on_the_forms_thread(kind):
    async def main():
        calls = Calls(asyncio.get_running_loop(), ThreadPoolExecutor(1), mpi=False)
        if kind == "async":
            async def handle(inputs):
                return inputs.content.size()
        else:
            async def handle(inputs):
                yield inputs.content.size()
        calls.handler_loaded(handle, kind)
        builds = Builds()
        await calls.call(*builds.of(multipart(10)))
        await calls.call(*builds.of(invoke(b"{}", "application/json")))
        calls.close()
        return builds.on

    built_on = asyncio.run(main())
    assert built_on[0].startswith("forms") and built_on[1] == threading.current_thread().name


def test_a_sync_handler_gets_its_input_built_in_its_own_pool_job():
    async def main():
        calls = Calls(asyncio.get_running_loop(), ThreadPoolExecutor(1, thread_name_prefix="handler"), mpi=False)
        calls.handler_loaded(lambda inputs: inputs.content.size(), "sync")
        builds = Builds()
        size = await calls.call(*builds.of(multipart(10)))
        calls.close()
        return size, builds.on

    size, built_on = asyncio.run(main())
    assert size == 10 and built_on[0].startswith("handler")
