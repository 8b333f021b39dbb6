"""A worker node's part of the built-in engine is configured as the leader's engine is (handlers/engines/vllm_node.py):
nodes whose vLLM derives other defaults (max_num_batched_tokens 2048 on one, 4096 on the other) warm up with
collectives of other sizes and die (gloo: "Received data size doesn't match expected size")."""

from vllm.engine.arg_utils import AsyncEngineArgs

from container.core.launch import EngineNodes, HeadlessLaunch
from container.core.settings import resolve_settings
from handlers.engines import vllm_node
from handlers.engines.vllm_args import build_engine_kwargs, node_kwargs, usage_context


def test_a_worker_node_has_the_leaders_scheduler_defaults(tiny_model):
    settings = resolve_settings({"TENSOR_PARALLEL_DEGREE": "2"}, tiny_model)
    leader_nodes, worker_nodes = (EngineNodes(2, rank, "127.0.0.1", 29511) for rank in (0, 1))
    kwargs = {**build_engine_kwargs(settings, str(tiny_model), 2, cpu=True), **node_kwargs(leader_nodes)}
    leader = AsyncEngineArgs(**kwargs).create_engine_config(usage_context=usage_context())  # as AsyncLLM's
    worker = vllm_node.engine_config(HeadlessLaunch(settings, str(tiny_model), 2, worker_nodes))
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        assert getattr(worker.scheduler_config, name) == getattr(leader.scheduler_config, name), name
    assert worker.compilation_config.compile_ranges_endpoints == leader.compilation_config.compile_ranges_endpoints
