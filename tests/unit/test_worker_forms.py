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
from container.worker.calls import Calls
from container.worker.requests import BodyRules, check_body, parses_form, request_input

BUILTIN = BodyRules(forms=False, max_parts=1000)
MODEL_PY = BodyRules(forms=True, max_parts=1000)


def invoke(body: bytes, content_type: str, query: str = "") -> Invoke:
    return Invoke(id="1", properties={"Content-Type": content_type}, body=body, path="/invocations", query=query)


def multipart(parts: int) -> Invoke:
    body, content_type = encode_multipart_formdata([(f"f{i}", "x") for i in range(parts)])
    return invoke(body, content_type)


def test_a_built_in_engine_refuses_multipart_with_415_without_reading_the_body():
    for message in (multipart(3), invoke(b"not a multipart body at all", "multipart/form-data; boundary=zz"),
                    invoke(b"", "Multipart/Form-Data")):
        with pytest.raises(UnsupportedMediaType) as caught:
            check_body(message, BUILTIN)
        status, _, detail = describe(caught.value)
        assert status == 415 and "multipart/form-data" in detail and "application/json" in detail


def test_a_built_in_engine_gets_a_url_encoded_body_whole():
    """curl -d labels JSON as a form; the engine reads JSON, so nothing is parsed as a form."""
    body = b'{"inputs": "a=b&c=d"}'
    message = invoke(body, "application/x-www-form-urlencoded", query="x=1")
    check_body(message, BUILTIN)
    assert not parses_form(message, BUILTIN)
    inputs = request_input(message, {}, BUILTIN)
    assert inputs.content.get_keys() == ["x", "data"] and inputs.get_as_json() == {"inputs": "a=b&c=d"}


def test_a_handler_gets_up_to_max_multipart_parts_as_fields():
    message = multipart(1000)
    check_body(message, MODEL_PY)
    assert parses_form(message, MODEL_PY)
    inputs = request_input(message, {}, MODEL_PY)
    assert inputs.content.size() == 1000 and inputs.get_as_string(key="f999") == "x"


def test_more_parts_are_400_naming_the_setting_counted_without_parsing():
    message = multipart(60_000)
    started = time.perf_counter()
    with pytest.raises(InputError) as caught:
        check_body(message, MODEL_PY)
    elapsed = time.perf_counter() - started
    assert "has 60000 parts" in str(caught.value) and "at most 1000" in str(caught.value)
    assert "max_multipart_parts" in str(caught.value) and "SERVING_MAX_MULTIPART_PARTS" in str(caught.value)
    assert elapsed < 0.5, f"counting 60,000 parts took {elapsed:.2f}s"  # the email parser takes about 10 s


def test_a_body_without_a_boundary_is_left_to_the_parse_to_refuse():
    message = invoke(b"whatever", "multipart/form-data")
    check_body(message, MODEL_PY)
    with pytest.raises(InputError, match="boundary"):
        request_input(message, {}, MODEL_PY)


class Handler:
    """Records the thread that built each Input."""

    def __init__(self) -> None:
        self.built_on: list[str] = []

    def build(self, message: Invoke):
        def build():
            self.built_on.append(threading.current_thread().name)
            return request_input(message, {}, MODEL_PY)
        return build


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
        handler = Handler()
        await calls.call(handler.build(multipart(10)), parse=True)
        await calls.call(handler.build(invoke(b"{}", "application/json")))
        calls.close()
        return handler.built_on

    built_on = asyncio.run(main())
    assert built_on[0].startswith("forms") and built_on[1] == threading.current_thread().name


def test_a_sync_handler_gets_its_input_built_in_its_own_pool_job():
    async def main():
        calls = Calls(asyncio.get_running_loop(), ThreadPoolExecutor(1, thread_name_prefix="handler"), mpi=False)
        calls.handler_loaded(lambda inputs: inputs.content.size(), "sync")
        handler = Handler()
        size = await calls.call(handler.build(multipart(10)), parse=True)
        calls.close()
        return size, handler.built_on

    size, built_on = asyncio.run(main())
    assert size == 10 and built_on[0].startswith("handler")
