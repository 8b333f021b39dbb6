"""Pooling models on the vLLM engine: embeddings, scores and reranking on the tiny model served
with ``option.task=text-embedding`` (vLLM's pooling runner, ``convert=embed``), through the
official openai client and plain HTTP, compared with vLLM's own offline ``LLM.embed()`` /
``LLM.score()`` on the same model, computed in this run (a subprocess, started while the
servers load).

Two servers: the README's (default normalisation, marked Matryoshka) and one with
``option.normalize=false``.
"""

import base64
import concurrent.futures
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, VLLM_CPU_ENV
from tests.readme import on_port, python_snippets, run_shell, section, serve_settings, shell_commands
from tests.references import Reference
from tests.server import Server

pytestmark = pytest.mark.slow

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "good night"]
QUERY, DOCUMENTS = "hello world", ["good night", "hello world", "the quick brown fox"]
TOLERANCE = 1e-4
_SECTION = section("Embeddings, scores and reranking")  # docs/engine.md
README_COMMANDS = shell_commands(_SECTION)
README_SNIPPET = next(p for p in python_snippets(_SECTION) if "embeddings.create" in p)
HF_OVERRIDES = {"is_matryoshka": True}
READY_TIMEOUT = 2 * ENGINE_READY_TIMEOUT  # vLLM's offline engine starts alongside the first server

# vLLM offline on the same model and settings as the servers: float32, pooling runner, embed.
REFERENCE = textwrap.dedent("""
    import json, sys
    if __name__ == "__main__":
        from vllm import LLM, PoolingParams
        texts, query, documents, overrides = json.loads(sys.argv[2])
        llm = LLM(model=sys.argv[1], runner="pooling", convert="embed", dtype="float32", enforce_eager=True, max_model_len=1024,
                  gpu_memory_utilization=0.3, hf_overrides=overrides)
        embed = lambda params=None: [o.outputs.embedding for o in llm.embed(texts, pooling_params=params)]
        out = {"embed": embed(), "raw": embed(PoolingParams(use_activation=False)),
               "dims32": embed(PoolingParams(dimensions=32)),
               "score": [o.outputs.score for o in llm.score(query, documents)]}
        print("REFERENCE " + json.dumps(out), flush=True)
""")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The README's tiny model."""
    directory = str(tmp_path_factory.mktemp("readme-tiny-embed"))
    written = run_shell(README_COMMANDS[0].replace("/tmp/tiny-embed", directory), 0, timeout=300)
    assert written.returncode == 0, written.stderr
    return directory


@pytest.fixture(scope="module")
def offline(model_dir):
    """vLLM's offline answers, started before the servers so that it loads while they do (unless they
    are kept from an earlier run: tests/references.py)."""
    reference = Reference(REFERENCE, model_dir, [json.dumps([TEXTS, QUERY, DOCUMENTS, HF_OVERRIDES])], "REFERENCE ")
    yield reference.start()
    reference.stop()


@pytest.fixture(scope="module")
def reference(offline):
    return offline.result()


@pytest.fixture(scope="module")
def server(model_dir, offline):
    """The README's server: its settings, its model."""
    env, _ = serve_settings(README_COMMANDS[1])
    assert env == {**VLLM_CPU_ENV, "OPTION_TASK": "text-embedding", "OPTION_DTYPE": "float32",
                   "OPTION_HF_OVERRIDES": json.dumps(HF_OVERRIDES)}
    with Server(model_dir, env={**env, **EAGER}, ready_timeout=READY_TIMEOUT) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def close(got, want, tolerance=TOLERANCE):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return got.shape == want.shape and float(np.max(np.abs(got - want))) < tolerance


def norm(vector):
    return math.sqrt(sum(x * x for x in vector))


def test_the_log_says_vllm_pools(server):
    assert "option.task=text-embedding: vLLM's pooling runner, convert=embed" in server.log()
    assert '"convert": "embed"' in server.log() and '"runner": "pooling"' in server.log()
    assert "warm-up request" not in server.log()  # a pooling model samples no token


def test_embeddings_float_equal_vllm_offline(client, reference, model_dir):
    answer = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == Path(model_dir).name
    assert close([d.embedding for d in answer.data], reference["embed"])
    assert all(abs(norm(d.embedding) - 1) < TOLERANCE for d in answer.data)  # vLLM's default: normalised
    assert answer.usage.prompt_tokens > len(TEXTS)


def test_embeddings_base64_equal_vllm_offline(client, reference):
    answer = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="base64")
    vectors = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in answer.data]
    assert close(vectors, reference["embed"])
    decoded = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks base64 and decodes itself
    assert close([d.embedding for d in decoded.data], reference["embed"])


_NUMPY_TYPES = {"float32": "f4", "float16": "f2"}
_BYTE_ORDER = {"little": "<", "big": ">", "native": "="}


def test_embeddings_bytes_equal_vllm_offline(server, reference):
    """vLLM's binary form: the vectors' bytes, and where each lies in a metadata header (not for bytes_only)."""
    answer = requests.post(server.url("/v1/embeddings"), timeout=60, json={
        "model": "tiny", "input": TEXTS, "encoding_format": "bytes", "embed_dtype": "float16", "endianness": "big"})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(answer.headers["metadata"])
    assert metadata["usage"]["prompt_tokens"] > len(TEXTS) and [d["index"] for d in metadata["data"]] == [0, 1, 2]
    vectors = [np.frombuffer(answer.content[d["start"]:d["end"]],
                             dtype=_BYTE_ORDER[d["endianness"]] + _NUMPY_TYPES[d["embed_dtype"]]).reshape(d["shape"])
               for d in metadata["data"]]
    assert {(d["embed_dtype"], d["endianness"]) for d in metadata["data"]} == {("float16", "big")}
    assert close(vectors, reference["embed"], tolerance=1e-3)  # float16's precision
    only = requests.post(server.url("/v1/embeddings"), timeout=60, json={
        "model": "tiny", "input": TEXTS, "encoding_format": "bytes_only", "embed_dtype": "float32",
        "endianness": "little"})
    assert only.status_code == 200 and "metadata" not in only.headers
    assert close(np.frombuffer(only.content, dtype="<f4").reshape(len(TEXTS), -1), reference["embed"])


def test_dimensions_equal_vllm_offline(client, reference):
    answer = client.embeddings.create(model="tiny", input=TEXTS, dimensions=32, encoding_format="float")
    assert close([d.embedding for d in answer.data], reference["dims32"])
    assert all(len(d.embedding) == 32 for d in answer.data)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="tiny", input=TEXTS, dimensions=1000)
    assert refused.value.status_code == 400 and "dimensions" in refused.value.message


def test_lmi_form_on_invocations_equal_vllm_offline(server, reference):
    many = server.invoke({"inputs": TEXTS})
    assert many.status_code == 200 and many.headers["content-type"].startswith("application/json")
    assert close(many.json(), reference["embed"])
    one = server.invoke({"inputs": TEXTS[0]})  # one string: a list of one vector, as LMI's vLLM handler
    assert close(one.json(), reference["embed"][:1])
    assert abs(norm(one.json()[0]) - 1) < TOLERANCE  # option.normalize unset: LMI's default, normalised
    openai_form = server.invoke({"input": TEXTS, "encoding_format": "float"})  # vLLM's form on /invocations
    assert close([d["embedding"] for d in openai_form.json()["data"]], reference["embed"])


def test_score_and_rerank_equal_vllm_offline(server, reference):
    want = reference["score"]
    score = requests.post(server.url("/v1/score"), json={"queries": QUERY, "documents": DOCUMENTS}, timeout=60)
    assert score.status_code == 200, score.text
    assert close([d["score"] for d in score.json()["data"]], want)
    texts = requests.post(server.url("/v1/score"), json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60)
    assert close([d["score"] for d in texts.json()["data"]], want)
    rerank = requests.post(server.url("/v1/rerank"), json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2},
                           timeout=60)
    assert rerank.status_code == 200, rerank.text
    results = rerank.json()["results"]
    order = sorted(range(len(want)), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in results] == order
    assert close([r["relevance_score"] for r in results], [want[i] for i in order])
    assert results[0]["document"]["text"] == DOCUMENTS[order[0]]
    on_invocations = server.invoke({"query": QUERY, "documents": DOCUMENTS})
    assert close(sorted(r["relevance_score"] for r in on_invocations.json()["results"]), sorted(want))


def test_generation_routes_are_refused_naming_the_task(server, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert "option.task=text-embedding" in refused.value.message and "/v1/embeddings" in refused.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi")
    lmi = server.invoke({"prompt": "hi"})
    assert lmi.status_code == 400 and "option.task=text-embedding" in lmi.json()["error"]
    assert set(lmi.json()) == {"code", "message", "error"}  # LMI's envelope on /invocations


def same_answer(got, want, tolerance=TOLERANCE):
    """``got`` equals ``want`` but for their ids and creation times, and floats within ``tolerance``."""
    if isinstance(want, dict):
        keys = set(want) - {"id", "created"}
        return set(got) - {"id", "created"} == keys and all(same_answer(got[k], want[k], tolerance) for k in keys)
    if isinstance(want, list):
        return len(got) == len(want) and all(same_answer(g, w, tolerance) for g, w in zip(got, want))
    if isinstance(want, float):
        return abs(got - want) < tolerance
    return got == want


@pytest.mark.parametrize("path, body", [
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "queries": "ignored"}),  # rerank before score
    ("/v1/score", {"queries": QUERY, "documents": DOCUMENTS}),
    ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    ("/v1/embeddings", {"input": TEXTS, "encoding_format": "float"}),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "hello world"}], "encoding_format": "float"}),
], ids=["rerank", "rerank-over-score", "score", "score-texts", "embeddings", "embeddings-chat"])
def test_vllm_bodies_on_invocations_answer_as_their_routes(server, path, body):
    """As AWS's vLLM container dispatches them (docs/http_api.md): the route's answer, in its form."""
    direct = requests.post(server.url(path), json=body, timeout=60)
    assert direct.status_code == 200, direct.text
    on_invocations = server.invoke(body)
    assert on_invocations.status_code == 200, on_invocations.text
    assert same_answer(on_invocations.json(), direct.json()), (on_invocations.text, direct.text)


def test_a_pooling_body_on_invocations_reaches_vllms_pooling_api(server):
    """{"data"} fits vLLM's pooling API alone (an IO processor plugin's form): vLLM's refusal, in LMI's envelope."""
    answer = server.invoke({"data": {"text": "hello"}})
    assert answer.status_code == 400 and set(answer.json()) == {"code", "message", "error"}, answer.text
    assert "No IOProcessor plugin installed" in answer.json()["error"]


@pytest.mark.parametrize("path, body, envelope", [
    ("/invocations", {"inputs": 5}, "lmi"),
    ("/invocations", {"inputs": []}, "lmi"),
    ("/v1/embeddings", {"input": 5}, "openai"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, "openai"),
    ("/v1/score", {"queries": "x"}, "openai"),
    ("/v1/rerank", {"query": "x", "documents": ["y"], "top_n": -1}, "openai"),
])
def test_bad_bodies_are_400_in_the_routes_envelope(server, path, body, envelope):
    answer = requests.post(server.url(path), json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    message = error["message"] if envelope == "openai" else error
    assert message and "Traceback" not in answer.text and "/tmp/" not in answer.text


def test_the_readme_examples(server, reference):
    port = server.port
    vectors, rerank = (json.loads(run_shell(c, port).stdout) for c in README_COMMANDS[2:])
    assert len(vectors) == 2 and all(len(v) == 128 and abs(norm(v) - 1) < TOLERANCE for v in vectors)
    assert [r["index"] for r in rerank["results"]] == [1, 0]  # "hello world" is itself: cosine 1
    printed = subprocess.run([sys.executable, "-c", on_port(README_SNIPPET, port)], capture_output=True,
                             text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == "[32, 32]"


def test_concurrent_requests_get_the_same_vectors(server, reference):
    """32 requests at once (vLLM batches them together): each gets what vLLM gives offline."""
    def one(i):
        return server.invoke({"inputs": TEXTS[i % 3]}).json()[0]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        vectors = list(pool.map(one, range(32)))
    assert all(close(v, reference["embed"][i % 3]) for i, v in enumerate(vectors))


def test_fuzzing_the_pooling_routes(server):
    """schemathesis on the pooling routes and /invocations from the served /openapi.json: every answer
    in its documented shape, no 5xx, no traceback or local path; the server healthy afterwards."""
    from tests.e2e.test_fuzz import Tally, run_fuzzing
    tally = Tally(builtin=True)
    failures = run_fuzzing(server, tally, paths=("/v1/embeddings", "/v1/score", "/v1/rerank", "/invocations"))
    assert not failures, "\n".join(failures)
    assert not tally.unexpected and sum(tally.statuses.values()) > 0
    assert requests.get(server.url("/ping"), timeout=60).status_code == 200
    assert "Traceback" not in server.log()


@pytest.fixture(scope="module")
def raw_server(model_dir, server):
    env = {**serve_settings(README_COMMANDS[1])[0], **EAGER, "OPTION_NORMALIZE": "false"}
    with Server(model_dir, env=env, ready_timeout=READY_TIMEOUT) as raw:
        yield raw


def test_normalize_false_gives_the_raw_vectors(raw_server, reference):
    lmi = raw_server.invoke({"inputs": TEXTS})
    assert close(lmi.json(), reference["raw"])  # unnormalised
    assert all(abs(norm(v) - 1) > 0.1 for v in lmi.json())
    client = openai.OpenAI(base_url=raw_server.url("/v1"), api_key="unused", max_retries=0)
    default = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert close([d.embedding for d in default.data], reference["raw"])
    asked = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float",
                                     extra_body={"use_activation": True})  # the request's own choice wins
    assert close([d.embedding for d in asked.data], reference["embed"])


@pytest.mark.parametrize("path, body", [
    ("/invocations", {"inputs": ["x"] * 5000}),  # LMI's embedding form
    ("/v1/embeddings", {"input": ["x"] * 5000}),
    ("/invocations", {"input": [[1, 2]] * 5000}),
    ("/v1/score", {"queries": "x", "documents": ["x"] * 5000}),
    ("/v1/rerank", {"query": "x", "documents": ["x"] * 5000}),
], ids=["lmi", "embeddings", "embeddings-tokens-on-invocations", "score", "rerank"])
def test_too_many_prompts_are_400_naming_the_setting(server, path, body):
    """Each of them was one engine request per item, however many (max_prompts_per_request)."""
    answer = requests.post(server.url(path), json=body, timeout=60)
    assert answer.status_code == 400, answer.text[:500]
    error = answer.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    assert "holds 5000 prompts; a request may hold at most 1024" in message
    assert "max_prompts_per_request" in message
