"""The Hugging Face Accelerate engine (option.rolling_batch=disable, or a task vLLM does not
serve) on locally written tiny models, through real servers and /invocations: answers equal
to transformers called directly (greedy), streaming, dynamic batching, 4xx for bad input."""

import concurrent.futures
import json
import re

import pytest
import requests

from tests import models
from tests.server import Server

pytestmark = pytest.mark.slow  # three servers and transformers in this process


def _write(tmp_path_factory, arch):
    return models.tiny_model(f"tiny-{arch}", "--arch", arch)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = _write(tmp_path_factory, "llama")
    env = {"OPTION_ROLLING_BATCH": "disable", "SERVING_BATCH_SIZE": "4", "SERVING_MAX_BATCH_DELAY": "300",
           "OPTION_DTYPE": "fp32"}
    with Server(directory, env=env, ready_timeout=120) as server:
        yield server


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    directory = _write(tmp_path_factory, "t5")
    with Server(directory, env={"OPTION_TASK": "text2text-generation"}, ready_timeout=120) as server:
        yield server


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    directory = _write(tmp_path_factory, "bert")
    with Server(directory, env={"OPTION_TASK": "text-embedding", "OPTION_ROLLING_BATCH": "disable"},
                ready_timeout=120) as server:
        yield server


def _greedy(directory, prompts, max_new_tokens, seq2seq=False):
    """What transformers answers, called directly: each prompt alone, greedy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(directory).eval()
    texts = []
    for prompt in prompts:
        encoded = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False)
        start = 1 if seq2seq else encoded["input_ids"].shape[1]
        texts.append(tokenizer.decode(out[0, start:], skip_special_tokens=True))
    return texts


def test_text_generation_equals_transformers_and_says_which_engine(llama):
    prompts = ["hello world", "the quick brown fox"]
    expected = _greedy(llama.model_dir, prompts, 12)
    for prompt, text in zip(prompts, expected):
        r = llama.invoke({"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}})
        assert r.status_code == 200, r.text
        assert r.json()["generated_text"] == text
        details = r.json()["details"]
        assert details["generated_tokens"] == len(details["tokens"]) and details["finish_reason"] in ("length",
                                                                                                    "eos_token")
        assert all(t["log_prob"] <= 0 for t in details["tokens"])
    assert ("ENGINE: the Hugging Face Accelerate engine (transformers) serves this model, because "
            "option.rolling_batch=disable") in llama.log()


def test_streaming_sends_tokens_that_add_up_to_the_whole_answer(llama):
    expected = _greedy(llama.model_dir, ["hello world"], 10)[0]
    r = requests.post(llama.url("/invocations"), json={"inputs": "hello world", "stream": True,
                                                       "parameters": {"max_new_tokens": 10}}, stream=True, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/jsonlines")
    lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) == 10 and all("token" in line for line in lines)
    assert "".join(line["token"]["text"] for line in lines) == expected
    assert lines[-1]["generated_text"] == expected


def test_eight_concurrent_requests_reach_the_model_in_batches_of_up_to_four(llama):
    prompts = [f"the {word} fox jumps" for word in "red green blue yellow black white warm cold".split()]
    expected = _greedy(llama.model_dir, prompts, 8)
    before = len(re.findall(r"model call: batch of (\d+)", llama.log()))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: llama.invoke({"inputs": p, "parameters": {"max_new_tokens": 8}}), prompts))
    for answer, text in zip(answers, expected):
        assert answer.status_code == 200, answer.text
        assert answer.json()["generated_text"] == text  # each client its own answer, equal to unbatched
    sizes = [int(n) for n in re.findall(r"model call: batch of (\d+)", llama.log())[before:]]
    assert sum(sizes) == 8 and max(sizes) <= 4 and max(sizes) > 1, sizes


@pytest.mark.parametrize("body, needle", [
    ({"inputs": 3}, "'inputs' must be a non-empty string"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"prompt": "x"}, "'inputs'"),
])
def test_bad_input_is_a_400_in_lmi_envelope(llama, body, needle):
    r = llama.invoke(body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"] and "Traceback" not in r.text


def test_text2text_generation_on_a_t5_equals_transformers(t5):
    prompts = ["hello world", "read the long answer"]
    expected = _greedy(t5.model_dir, prompts, 9, seq2seq=True)
    r = t5.invoke({"inputs": prompts, "parameters": {"max_new_tokens": 9}})
    assert r.status_code == 200, r.text
    assert [a["generated_text"] for a in r.json()] == expected
    assert "option.task=text2text-generation, which vLLM does not serve" in t5.log()


def test_embeddings_are_one_normalised_vector_per_input(bert):
    import torch
    from transformers import AutoModel, AutoTokenizer
    texts = ["the quick brown fox", "hello world"]
    r = bert.invoke({"inputs": texts})
    assert r.status_code == 200, r.text
    vectors = r.json()
    tokenizer, model = AutoTokenizer.from_pretrained(bert.model_dir), AutoModel.from_pretrained(bert.model_dir)
    for text, vector in zip(texts, vectors):
        with torch.inference_mode():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].mean(0)
        expected = torch.nn.functional.normalize(hidden, dim=0)
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-5)
    single = bert.invoke({"inputs": "hello world"}).json()
    assert len(single) == 64 and single == pytest.approx(vectors[1], abs=1e-5)
    assert bert.invoke({"inputs": []}).status_code == 400


@pytest.mark.parametrize("task, text", [("text-classification", "the quick brown fox"),
                                        ("token-classification", "the quick brown fox"),
                                        ("fill-mask", "the quick brown [MASK] jumps"),
                                        ("feature-extraction", "hello world")])
def test_pipeline_tasks_answer_as_the_transformers_pipeline(tmp_path_factory, task, text):
    """In-process (no server): the engine's answer for the encoder tasks is the pipeline's."""
    import transformers
    from transformers import AutoTokenizer, pipeline

    from handlers.api import Input
    from handlers.engines.accelerate import PIPELINE_TASKS, AccelerateEngine, _plain
    from handlers.engines.lmi_schema import Formatter
    directory = str(_bert_dir(tmp_path_factory))
    model = getattr(transformers, PIPELINE_TASKS[task]).from_pretrained(directory).eval()
    service = AccelerateEngine(task, model, AutoTokenizer.from_pretrained(directory), Formatter("jsonlines", False))
    answer = json.loads(service.answer(Input(body=json.dumps({"inputs": text}).encode())).body())
    assert _rounded(answer) == _rounded(_plain(pipeline(task, model=directory)(text)))
    if task == "fill-mask":
        from container.core.errors import InputError
        with pytest.raises(InputError):
            service.answer(Input(body=b'{"inputs": "no mask here"}'))


def test_too_many_inputs_are_400_naming_the_setting(tmp_path_factory):
    """In-process: a list of inputs was one model call over all of them, however many."""
    from transformers import AutoModel, AutoTokenizer

    from container.core.errors import InputError
    from handlers.api import Input
    from handlers.engines.accelerate import AccelerateEngine
    from handlers.engines.lmi_schema import Formatter
    directory = str(_bert_dir(tmp_path_factory))
    service = AccelerateEngine("text-embedding", AutoModel.from_pretrained(directory).eval(),
                               AutoTokenizer.from_pretrained(directory), Formatter("jsonlines", False))
    with pytest.raises(InputError, match="'inputs' holds 5000 prompts; a request may hold at most 1024"):
        service.answer(Input(body=json.dumps({"inputs": ["hello"] * 5000}).encode()))
    assert len(json.loads(service.answer(Input(body=b'{"inputs": ["hello", "world"]}')).body())) == 2


_BERT = {}


def _bert_dir(tmp_path_factory):
    if "dir" not in _BERT:
        _BERT["dir"] = _write(tmp_path_factory, "bert")
    return _BERT["dir"]


def _rounded(value):
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return round(value, 4) if isinstance(value, float) else value
