"""Which adapter a request gets from SageMaker's X-Amzn-SageMaker-Adapter-Identifier header beside
LMI's ``adapters`` field or an OpenAI body's ``model`` (handlers.engines.vllm_adapters.Adapters)."""

from types import SimpleNamespace

import pytest
from vllm.lora.request import LoRARequest

from container.core.errors import InputError, NotFound
from handlers.engines.vllm_adapters import ADAPTER_HEADER, Adapters


@pytest.fixture
def adapters():
    table = {name: LoRARequest(lora_name=name, lora_int_id=i, lora_path=f"/a/{name}")
             for i, name in enumerate(("a1", "a2"), 1)}
    return Adapters(None, SimpleNamespace(lora_requests=table), ("tiny-model", "tiny"), lora=True)


def names(loras):
    return [lora.lora_name if lora is not None else None for lora in loras]


@pytest.mark.parametrize("body, header, prompts, chosen", [
    ({"adapters": "a1"}, None, 1, ["a1"]),
    ({}, "a1", 1, ["a1"]),  # the header alone: as the field does
    ({"adapters": None}, "a1", 1, ["a1"]),  # null is no choice, as in LMI
    ({"adapters": "a1"}, "a1", 1, ["a1"]),  # both, the same adapter
    ({"adapters": ["a1", "a1"]}, "a1", 2, ["a1", "a1"]),
    ({}, "a2", 3, ["a2"] * 3),  # one adapter for every input of a list
    ({"adapters": ["a2", None]}, None, 2, ["a2", None]),
    ({}, None, 1, [None]),
])
def test_the_header_chooses_as_lmis_field_does(adapters, body, header, prompts, chosen):
    assert names(adapters.for_lmi(body, header, prompts)) == chosen


@pytest.mark.parametrize("body, other", [
    ({"adapters": "a2"}, "'a2'"),
    ({"adapters": ["a1", "a2"]}, "'a2'"),
    ({"adapters": ["a1", None]}, "null (the base model)"),
    ({"adapters": "tiny"}, "'tiny'"),
])
def test_the_header_and_a_different_field_are_refused(adapters, body, other):
    with pytest.raises(InputError) as refused:
        adapters.for_lmi(body, "a1", len(body["adapters"]) if isinstance(body["adapters"], list) else 1)
    assert str(refused.value) == (f"the {ADAPTER_HEADER} header names adapter 'a1' and the body's 'adapters' "
                                  f"{other}: name the adapter in one of them (or the same one in both)")


def test_the_header_replaces_an_openai_model(adapters):
    assert adapters.for_openai("tiny-model", "a1") == "a1"
    assert adapters.for_openai("a2", "a1") == "a1"  # as AWS's vLLM container: the header replaces model
    assert adapters.for_openai("a2", None) == "a2"
    assert adapters.for_openai(None, None) == "tiny-model"


def test_an_unregistered_adapter_in_the_header_is_a_404_naming_it(adapters):
    del adapters.table["a2"]  # as DELETE /adapters/a2 leaves it
    for choose in (lambda: adapters.for_lmi({}, "a2", 1), lambda: adapters.for_openai("tiny-model", "a2")):
        with pytest.raises(NotFound, match="adapter 'a2' is not registered"):
            choose()
