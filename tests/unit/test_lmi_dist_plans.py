"""lmi-dist's plans cross the rank relay as msgpack (vLLM's encoder and decoder), never as pickles:
a follower decodes only a Plan, and calls only the engine methods a plan may name. The engine
itself runs in tests/e2e/test_lmi_dist.py."""

import os
import pickle
import threading

import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.engine import EngineCoreRequest

from handlers.engines.lmi_dist import (
    AbortRequests,
    AddLora,
    AddRequest,
    EngineCall,
    LockstepCore,
    Plan,
    PlanCodec,
    _follow,
)


def _request() -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="r1", prompt_token_ids=[5, 6, 7], mm_features=None,
        sampling_params=SamplingParams(max_tokens=8, temperature=0.7, seed=11), pooling_params=None,
        arrival_time=12.5, lora_request=LoRARequest("tiny", 1, "/adapters/tiny"), cache_salt="s",
        data_parallel_rank=None, prompt_embeds=torch.arange(900, dtype=torch.float32).reshape(30, 30))


def test_a_plan_crosses_the_relay_whole():
    plan = Plan([AddRequest(_request()), AbortRequests(["r0"]), AddLora(LoRARequest("other", 2, "/a/other")),
                 EngineCall("reset_prefix_cache", [True, False]), EngineCall("pin_lora", [2])])
    back = PlanCodec().decode(PlanCodec().encode(plan))
    request = back.ops[0].request
    assert isinstance(request, EngineCoreRequest) and request.prompt_token_ids == [5, 6, 7]
    assert request.sampling_params.seed == 11 and request.sampling_params.max_tokens == 8
    assert request.lora_request == LoRARequest("tiny", 1, "/adapters/tiny")
    assert torch.equal(request.prompt_embeds, _request().prompt_embeds)
    assert back.ops[1:] == plan.ops[1:] and back.stop is False


class _Context:
    def __init__(self, *broadcasts: bytes) -> None:
        self.broadcasts = list(broadcasts)

    def next_broadcast(self) -> bytes | None:
        return self.broadcasts.pop(0) if self.broadcasts else None


class _Core:
    """What a follower's lockstep calls on vLLM's engine core, recorded."""

    def __init__(self) -> None:
        self.calls: list = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, args))


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_pickle_on_the_relay_runs_nothing_on_a_follower(tmp_path, caplog):
    target = tmp_path / "pwned"
    lockstep = LockstepCore(_Core())
    _follow(lockstep, _Context(pickle.dumps(_Exploit(str(target)))), threading.Event())
    assert not target.exists()
    assert lockstep.error is not None and "the lmi-dist engine failed" in caplog.text  # the group restarts


@pytest.mark.parametrize("method", ["shutdown", "__init__", "_handle_client_request", "collective_rpc"])
def test_a_plan_calls_only_the_engine_methods_a_leader_client_makes(method):
    core = _Core()
    results = LockstepCore(core).apply(Plan([EngineCall(method, []), EngineCall("remove_lora", [3])]))
    assert isinstance(results[0], ValueError) and f"{method} is not an engine call a plan may make" in str(results[0])
    assert core.calls == [("remove_lora", (3,))]
