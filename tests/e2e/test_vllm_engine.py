"""The engine under load, against offline vLLM, and when clients walk away."""

import concurrent.futures
import json
import textwrap
import time

import pytest
import requests

from tests.e2e.conftest import HUB_TOKEN, VLLM_CPU_ENV
from tests.references import offline_reference
from tests.server import (
    RawStream,
    Server,
    drop_stream_and_wait_until_idle,
    metric,
    nice_of_threads,
    processes,
    wait_idle,
)

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"


LONG_PROMPT = "red green " * 1500  # about 3000 tokens: more than one engine step takes (2048 on the CPU)

# vLLM offline on the tiny model, as the session's server runs it (float32, 64 sequences): the greedy
# answer to PROMPT, and a seeded sample of LONG_PROMPT taken in one step (8192 tokens a step).
OFFLINE = textwrap.dedent("""
    import json, sys
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        prompt, long_prompt = json.loads(sys.argv[2])
        llm = LLM(model=sys.argv[1], gpu_memory_utilization=0.5, max_num_seqs=64, dtype="float32",
                  max_num_batched_tokens=8192)
        greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        seeded = llm.generate([long_prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)
        print("REFERENCE=" + json.dumps({"greedy": list(greedy[0].outputs[0].token_ids),
                                         "seeded": list(seeded[0].outputs[0].token_ids)}), flush=True)
""")


@pytest.fixture(scope="module")
def offline(tiny_model):
    return offline_reference(OFFLINE, tiny_model, [json.dumps([PROMPT, LONG_PROMPT])], "REFERENCE=")


def test_greedy_answer_equals_offline_vllm(vllm_server, offline):
    served = vllm_server.invoke({"inputs": PROMPT, "parameters": {
        "max_new_tokens": 24, "details": True, "ignore_eos": True}}).json()
    assert [t["id"] for t in served["details"]["tokens"]] == offline["greedy"]


def test_the_hub_token_never_reaches_the_log(vllm_server):
    """option.hf_token is a setting the supervisor logs and an engine argument the worker logs
    ("starting vLLM with ..."): both show it as ***."""
    log = vllm_server.log()
    assert HUB_TOKEN not in log
    assert "setting option.hf_token=*** (env OPTION_HF_TOKEN (passed to the handler))" in log
    starting = [line for line in log.splitlines() if "starting vLLM with" in line]
    assert len(starting) == 1 and '"hf_token": "***"' in starting[0]


def test_the_worker_reports_ready_after_a_warm_up_request(vllm_server):
    """vLLM compiles its token-ranking kernel on the first request asking for log probabilities (every
    LMI request does): the worker asks for one token with its log probability before it is ready."""
    log = vllm_server.log()
    assert "warm-up request failed" not in log
    warmed = log.index("vLLM answered a warm-up request (token log probabilities)")
    assert warmed < log.index("worker group 0 is ready")


def test_a_seeded_sample_of_a_prompt_split_across_steps_is_answered_as_if_taken_whole(vllm_server, offline):
    """vLLM 0.32's CPU build died on this ("CPU Generator does not use offset": every request in
    flight 503, /ping 503 for ~25 s); handlers/engines/vllm_cpu.py's model runner rewinds the seeded generator
    by its state. The answer must be what offline vLLM gives when the whole prompt fits in one step."""
    body = {"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": 16, "do_sample": True, "seed": 7,
                                                  "details": True, "ignore_eos": True}}
    answers = [vllm_server.invoke(body, timeout=120) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], answers[-1].text
    served = [[t["id"] for t in a.json()["details"]["tokens"]] for a in answers]
    assert served[0] == served[1]
    assert "does not use offset" not in vllm_server.log()
    assert served[0] == offline["seeded"]


def _stream_tokens(server, n):
    with server.invoke({"inputs": f"Stream number {n}", "stream": True,
                        "parameters": {"max_new_tokens": 40, "ignore_eos": True, "do_sample": True, "seed": n}},
                       stream=True, timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line]


def test_32_concurrent_streams_each_get_exactly_the_tokens_asked_for(vllm_server):
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda n: _stream_tokens(vllm_server, n), range(32)))
    for lines in results:
        assert sum("token" in line for line in lines) == 40
        assert lines[-1]["generated_text"]


@pytest.mark.parametrize("body", [  # ~10 s of decoding: the engine is still at it when the client leaves
    {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 8000, "ignore_eos": True}},
    {"prompt": "Hello", "stream": True, "max_tokens": 8000, "ignore_eos": True},
], ids=["lmi", "openai"])
def test_a_dropped_stream_leaves_no_request_in_the_engine(vllm_server, body):
    seconds, generated = drop_stream_and_wait_until_idle(vllm_server, "/invocations", body, tokens=8000)
    print(f"engine empty {1000 * seconds:.0f} ms after the client went away, {generated:.0f} tokens generated")


def test_an_lmi_stream_has_its_headers_while_it_waits_for_the_engine(vllm_server):
    """A stream's status and headers go out once the engine has taken the request, not with its
    first token (they travel while the engine works on it): with every place in the engine taken
    by a long stream, one more is answered 200 while it still waits for a place; what the engine
    refuses is still a 400 (tests/e2e/test_vllm_lmi.py)."""
    places = 64  # OPTION_MAX_ROLLING_BATCH_SIZE of the shared server (tests/conftest.py)
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}
    streams: list[RawStream] = []
    try:
        for _ in range(places):
            streams.append(RawStream(vllm_server.port, "/invocations", body))
        streams.append(waiting := RawStream(vllm_server.port, "/invocations", body, timeout=20))
        assert waiting.response.status == 200
        assert waiting.response.getheader("content-type") == "application/jsonlines"
        # vLLM's gauges follow its steps: once they show every place taken, the last stream is the
        # one still waiting (none of the others can have finished 4000 tokens meanwhile)
        deadline = time.monotonic() + 60
        while metric(vllm_server, "vllm:num_requests_running") < places:
            assert time.monotonic() < deadline, "the engine never ran all its places"
            time.sleep(0.2)
        assert metric(vllm_server, "vllm:num_requests_waiting") == 1
    finally:
        for stream in streams:
            stream.close()
    wait_idle(vllm_server)


def test_metrics_carry_the_gauges_sagemakers_routers_and_autoscalers_read(vllm_server):
    """HyperPod's inference gateway and KEDA's Prometheus triggers read vLLM's own gauges by these names
    (several groups and MPI ranks: tests/unit/test_router_gauges.py); the KV cache's is live."""
    from prometheus_client.parser import text_string_to_metric_families

    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}
    stream = RawStream(vllm_server.port, "/invocations", body)
    try:
        assert stream.read_lines(2)
        text = requests.get(vllm_server.url("/metrics"), timeout=60).text
    finally:
        stream.close()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in text
        (sample,) = families[name].samples
        assert sample.name == name and sample.labels["group"] == "0" and "model_name" in sample.labels
    assert families["vllm:num_requests_waiting"].samples[0].value == 0
    assert 0 < families["vllm:kv_cache_usage_perc"].samples[0].value < 1  # the stream's blocks
    wait_idle(vllm_server)


def _lmi_priority(p: int) -> tuple[dict, dict]:
    return {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "priority": p}}, {}


def _header_priority(p: int) -> tuple[dict, dict]:
    return {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}, {"X-Priority": str(p)}


def _v1_header_priority(p: int) -> tuple[dict, dict]:
    return {"prompt": PROMPT, "max_tokens": 2}, {"X-Priority": str(p)}


def _body_priority(p: int) -> tuple[dict, dict]:
    return {"prompt": PROMPT, "max_tokens": 2, "priority": p}, {}


def _chat_priority(p: int) -> tuple[dict, dict]:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": p}, {}


@pytest.mark.parametrize("path,make,where", [
    ("/invocations", _lmi_priority, "parameters.priority"),
    ("/invocations", _header_priority, "X-Priority"),
    ("/invocations", _body_priority, "priority"),
    ("/v1/completions", _body_priority, "priority"),
    ("/v1/completions", _v1_header_priority, "X-Priority"),
    ("/v1/chat/completions", _chat_priority, "priority"),
], ids=["lmi", "header", "openai-on-invocations", "completions", "completions-header", "chat"])
def test_a_priority_on_a_first_come_server_is_a_400_naming_the_option(vllm_server, path, make, where):
    """vllm_server leaves option.scheduling_policy at vLLM's fcfs: a request that asks to be served
    before (or after) others is refused, where vLLM 0.32's engine would ignore it; priority 0, every
    request's default, is served."""
    for priority in (-1, 3):
        body, headers = make(priority)
        r = requests.post(vllm_server.url(path), json=body, headers=headers, timeout=60)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["error"]
        assert message.startswith(f"{where}={priority}: ") and "option.scheduling_policy=priority" in message, message
        if path.startswith("/v1/") and where == "priority":
            assert r.json()["error"]["param"] == "priority"
    body, headers = make(0)
    r = requests.post(vllm_server.url(path), json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def test_unknown_option_stops_start_up_naming_it(tiny_model):
    server = Server(tiny_model, env={**VLLM_CPU_ENV, "OPTION_MAX_NUM_SEQ": "8"}).start(wait_ready=False)
    assert server.wait_exit(120) == 2  # a setting that cannot work: refused before any worker starts
    assert "option.max_num_seq is neither an LMI option nor a vLLM engine argument; did you mean " \
           "option.max_num_seqs" in server.log()


def _engine_nice(worker: int) -> set[int]:
    engine = processes(worker)
    del engine[worker]
    assert any("VLLM::EngineCore" in command for command in engine.values()), engine
    return set().union(*(nice_of_threads(pid) for pid in engine))


def test_the_engine_runs_below_the_request_path_while_it_serves_many(vllm_server):
    """vLLM's EngineCore and its worker busy-wait between steps: with more than SHARED_UP_TO
    requests in flight, every one of their threads runs at nice 10 (ENGINE_NICE), the model
    worker's at 0; RESTORE_AFTER seconds after the burst they share the CPU at nice 0 again.
    (The hold at one request is tests/unit/test_engine_priority.py's: one answer of the tiny
    model lasts about a second.)"""
    from container.core.proc import ENGINE_NICE
    from container.worker.priority import RESTORE_AFTER, SHARED_UP_TO

    (worker,) = vllm_server.worker_pids()
    deadline = time.monotonic() + RESTORE_AFTER + 30  # a burst of an earlier test may still be held
    while _engine_nice(worker) != {0}:
        assert time.monotonic() < deadline, "the engine did not get nice 0 back"
        time.sleep(0.2)
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 900, "ignore_eos": True}}
    streams = [RawStream(vllm_server.port, "/invocations", body) for _ in range(SHARED_UP_TO + 1)]
    for stream in streams:
        stream.read_lines(1)
    assert _engine_nice(worker) == {ENGINE_NICE}
    assert nice_of_threads(worker) == {0}
    for stream in streams:
        stream.close()
    ended = time.monotonic()
    time.sleep(RESTORE_AFTER / 2)
    assert _engine_nice(worker) == {ENGINE_NICE}, "given back before RESTORE_AFTER"
    while _engine_nice(worker) != {0}:
        assert time.monotonic() < ended + RESTORE_AFTER + 10, "the engine did not get nice 0 back"
        time.sleep(0.2)
