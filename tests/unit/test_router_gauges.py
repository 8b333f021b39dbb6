"""The two vLLM gauges SageMaker's routers and autoscalers read from /metrics (HyperPod's inference
gateway, KEDA's Prometheus triggers): ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``
keep exactly those names and their gauge type through the frontend's merge of the worker groups'
texts, whatever the layout: one group, several, an MPI group's ranks. (On real engines:
tests/e2e/test_vllm_engine.py, one group; tests/e2e/test_lmi_dist.py, tensor parallel 2.)"""

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from container.core.metrics_text import merge
from container.frontend.metrics import FrontendMetrics

GAUGES = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def engine_text(waiting: float, usage: float, with_engine: bool = True) -> str:
    """What a worker process's registry holds: vLLM's gauges as its Prometheus logger declares them
    (labels model_name and engine), a counter of vLLM's and sagelmi's own gauge; an MPI rank that
    runs no engine (another rank of a model.py in MPI mode) has only the last."""
    registry = CollectorRegistry()
    if with_engine:
        labels = ["model_name", "engine"]
        Gauge(GAUGES[0], "Number of requests waiting to be processed.", labels, registry=registry).labels(
            "tiny", "0"
        ).set(waiting)
        Gauge(GAUGES[1], "KV-cache usage. 1 means 100 percent usage.", labels, registry=registry).labels(
            "tiny", "0"
        ).set(usage)
        Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=registry).labels(
            "tiny", "0"
        ).inc(7)
    Gauge("sagelmi_engine_unfinished_requests", "Requests the engine is running or has queued", registry=registry).set(
        waiting
    )
    return generate_latest(registry).decode()


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``name``'s samples in ``text``, by their labels other than vLLM's own."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                assert family.type == "gauge", (name, family.type)
                found[tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine")))] = (
                    sample.value
                )
    return found


def exposition(group_texts: dict[str, str]) -> str:
    return FrontendMetrics().render(group_texts).decode()


def assert_declared_once(text: str) -> None:
    for name in GAUGES:
        assert text.count(f"# TYPE {name} gauge\n") == 1, name
        assert f"\n{name}{{" in text  # the exact name, no prefix or suffix added


def test_one_group_carries_both_gauges_under_vllms_names():
    text = exposition({"0": engine_text(3, 0.25)})
    assert_declared_once(text)
    assert samples(text, GAUGES[0]) == {(("group", "0"),): 3}
    assert samples(text, GAUGES[1]) == {(("group", "0"),): 0.25}


def test_several_groups_give_one_series_each_in_one_family():
    text = exposition({"0": engine_text(3, 0.25), "1": engine_text(5, 0.5), "2": engine_text(0, 0)})
    assert_declared_once(text)
    assert samples(text, GAUGES[0]) == {(("group", "0"),): 3, (("group", "1"),): 5, (("group", "2"),): 0}
    assert samples(text, GAUGES[1]) == {(("group", "0"),): 0.25, (("group", "1"),): 0.5, (("group", "2"),): 0}
    assert sum(samples(text, GAUGES[0]).values()) == 8  # what sum(vllm:num_requests_waiting) gives the pod


def test_mpi_groups_carry_rank_0s_gauges_labelled_with_group_and_rank():
    """A model.py in MPI mode whose rank 0 alone runs vLLM (its gauges); each group's rank 0 merges its ranks' texts (container.worker.observe) before the frontend merges groups."""
    group = {str(g): merge({"0": engine_text(g + 1, 0.1), "1": engine_text(0, 0, with_engine=False)}, "rank").decode()
             for g in range(2)}
    text = exposition(group)
    assert_declared_once(text)
    assert samples(text, GAUGES[0]) == {(("group", "0"), ("rank", "0")): 1, (("group", "1"), ("rank", "0")): 2}
    assert samples(text, GAUGES[1]) == {(("group", "0"), ("rank", "0")): 0.1, (("group", "1"), ("rank", "0")): 0.1}
