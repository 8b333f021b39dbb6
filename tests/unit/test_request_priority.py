"""Request priorities without an engine: the X-Priority header and the body fields, their
refusals, and the worker's queue (container/worker/batching.py), whose waiting requests leave
in priority order (lower first), first-come among equals."""

import asyncio

import pytest

from container.core.errors import InputError
from container.core.protocol import Invoke
from container.core.request_priority import check_allowed, header_priority
from container.core.settings import resolve_settings
from container.worker.batching import Batcher
from handlers.engines.lmi_schema import parse_request

INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("properties,expected", [
    ({}, None),
    ({"Content-Type": "application/json"}, None),
    ({"X-Priority": "3"}, 3),
    ({"x-priority": " -2 "}, -2),  # a SageMaker custom attribute (x-priority=-2) becomes this property
    ({"X-PRIORITY": "+7"}, 7),
    ({"X-Priority": str(INT64_MAX)}, INT64_MAX),
    ({"X-Priority": str(-INT64_MAX - 1)}, -INT64_MAX - 1),
])
def test_the_header_names_a_whole_number(properties, expected):
    assert header_priority(properties) == expected


@pytest.mark.parametrize("value,fragment", [
    ("high", "'high' is not a whole number"),
    ("1.5", "'1.5' is not a whole number"),
    ("", "'' is not a whole number"),
    ("١", "is not a whole number"),  # a digit, but not an ASCII one
    ("1 2", "is not a whole number"),
    (str(INT64_MAX + 1), "out of range"),
    ("9" * 5000, "is not a whole number"),
])
def test_a_header_that_is_no_int64_is_refused_naming_it(value, fragment):
    with pytest.raises(InputError) as caught:
        header_priority({"X-Priority": value})
    assert caught.value.detail.startswith("X-Priority: ") and fragment in caught.value.detail
    assert len(caught.value.detail) < 200  # a long value is not echoed whole


def test_a_priority_needs_the_priority_scheduling_policy():
    check_allowed(None, "X-Priority", scheduled=False)
    check_allowed(0, "priority", scheduled=False)  # every request's default: it asks for nothing
    check_allowed(-5, "priority", scheduled=True)
    with pytest.raises(InputError) as caught:
        check_allowed(2, "parameters.priority", scheduled=False)
    assert caught.value.status == 400
    assert caught.value.detail.startswith("parameters.priority=2: ")
    assert "option.scheduling_policy=priority" in caught.value.detail


@pytest.mark.parametrize("env,scheduled", [
    ({}, False),
    ({"OPTION_SCHEDULING_POLICY": "fcfs"}, False),
    ({"OPTION_SCHEDULING_POLICY": "priority"}, True),
    ({"SM_VLLM_SCHEDULING_POLICY": "priority"}, True),  # AWS's vLLM container's spelling
])
def test_settings_say_whether_requests_are_ordered_by_priority(tmp_path, env, scheduled):
    assert resolve_settings(env, tmp_path).priority_scheduling is scheduled


def test_lmi_parameters_carry_a_priority_within_int64():
    assert parse_request({"inputs": "x"}, set()).parameters.priority is None
    request = parse_request({"inputs": "x", "parameters": {"priority": -3}}, {"priority"})
    assert request.parameters.priority == -3
    assert "priority" not in request.sampling  # the engine's add_request takes it, not SamplingParams
    for bad in (INT64_MAX + 1, "soon", 1.5, [1]):
        with pytest.raises(InputError) as caught:
            parse_request({"inputs": "x", "parameters": {"priority": bad}}, set())
        assert caught.value.detail.startswith("parameters.priority: "), caught.value.detail


# -- the worker's queue


def _invoke(name: str, priority: int | None = None) -> Invoke:
    return Invoke(id=name, properties={} if priority is None else {"X-Priority": str(priority)}, body=b"")


async def _served(size: int, slots: int, queued: list[tuple[str, int | None]], cancel: str | None = None
                  ) -> list[list[str]]:
    """The batches ``Batcher`` hands its handler when ``queued`` ((name, X-Priority), in arrival order)
    arrive while its ``slots`` are taken by a first request, ``cancel`` leaving the queue meanwhile."""
    batches: list[list[str]] = []
    holding = asyncio.Event()
    release = asyncio.Event()

    async def run(batch):
        batches.append([message.id for _, message in batch])
        if batch[0][1].id == "first":
            holding.set()
            await release.wait()

    batcher = Batcher(size, 0, slots, run)
    batcher.start()
    try:
        batcher.submit("conn", _invoke("first"))
        await asyncio.wait_for(holding.wait(), 5)
        for name, priority in queued:
            batcher.submit("conn", _invoke(name, priority))
        if cancel is not None:
            batcher.cancel(cancel)
        release.set()
        while sum(map(len, batches)) < 1 + len(queued) - (cancel is not None):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # nothing else comes
        return batches[1:]
    finally:
        batcher.stop()


def test_waiting_requests_leave_lowest_priority_value_first_and_first_come_among_equals():
    queued = [("a", None), ("b", 5), ("c", -1), ("d", 0), ("e", -1), ("f", 5)]
    batches = asyncio.run(_served(1, 1, queued))
    assert batches == [["c"], ["e"], ["a"], ["d"], ["b"], ["f"]]


def test_without_priorities_the_queue_is_first_come():
    batches = asyncio.run(_served(1, 1, [(name, None) for name in "abcde"]))
    assert batches == [["a"], ["b"], ["c"], ["d"], ["e"]]


def test_batches_are_formed_in_priority_order():
    batches = asyncio.run(_served(2, 1, [("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", 0)]))
    assert batches == [["e", "b"], ["d", "c"], ["a"]]


def test_a_request_cancelled_while_it_waits_leaves_the_queue():
    batches = asyncio.run(_served(1, 1, [("a", 1), ("b", 0), ("c", 2)], cancel="b"))
    assert batches == [["a"], ["c"]]


def test_the_worker_refuses_a_bad_or_unscheduled_header_before_anything_reads_the_body():
    from container.worker.requests import Inputs

    first_come, by_priority = Inputs(priority_scheduling=False), Inputs(priority_scheduling=True)
    assert first_come.refusal(_invoke("a")) is None and first_come.refusal(_invoke("a", 0)) is None
    refused = first_come.refusal(_invoke("a", 4))
    assert isinstance(refused, InputError) and refused.detail.startswith("X-Priority=4: ")
    assert by_priority.refusal(_invoke("a", 4)) is None
    bad = Invoke(id="a", properties={"x-priority": "later"}, body=b"")
    assert by_priority.refusal(bad).detail.startswith("X-Priority: 'later' is not a whole number")


def test_a_messages_request_carries_the_header_priority_into_the_chat_request_vllm_schedules():
    """Anthropic's Messages schema has no priority: the X-Priority header's value (OpenAIFront.answer
    sets the request's priority from it alone) goes into the chat request vLLM's Messages class makes
    of it, the one it schedules."""
    from handlers.engines.vllm_openai import PrioritizedMessagesRequest, PrioritizedServingMessages

    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    request = PrioritizedMessagesRequest.model_validate({**body, "priority": -3})
    assert PrioritizedServingMessages.to_chat_completion_request(request).priority == -3
    plain = PrioritizedMessagesRequest.model_validate(body)
    assert PrioritizedServingMessages.to_chat_completion_request(plain).priority == 0
