"""Short prompts are tokenized on the worker's loop, not on vLLM's renderer thread
(handlers/engines/vllm_openai.py: tokenize_short_prompts_inline), with the renderer's own result."""

import asyncio
import types

import pytest

pytestmark = pytest.mark.slow  # builds vLLM's renderer for the tiny model (imports vLLM: seconds)


@pytest.fixture(scope="module")
def renderer(tiny_model):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers import renderer_from_config

    built = renderer_from_config(EngineArgs(model=str(tiny_model)).create_engine_config())
    yield built
    built.shutdown()


@pytest.fixture
def offloaded(renderer, monkeypatch):
    """What the renderer hands its thread pool."""
    sent = []
    submit = renderer._executor.submit

    def counted(fn, *args, **kwargs):
        sent.append(fn)
        return submit(fn, *args, **kwargs)

    monkeypatch.setattr(renderer._executor, "submit", counted)
    return sent


def test_a_short_prompt_is_tokenized_on_the_loop_and_a_long_one_on_the_renderer_thread(renderer, offloaded):
    from handlers.engines.vllm_openai import INLINE_TOKENIZE_CHARS, tokenize_short_prompts_inline

    params = renderer.default_cmpl_tok_params
    short, long = "The quick brown fox", "x y " * (INLINE_TOKENIZE_CHARS // 4 + 1)
    expected = [renderer.tokenize_prompt({"prompt": text}, params) for text in (short, long)]
    assert tokenize_short_prompts_inline(renderer)

    async def tokenize(text):
        return await renderer.tokenize_prompt_async({"prompt": text}, params)

    assert asyncio.run(tokenize(short)) == expected[0]
    assert offloaded == []
    assert asyncio.run(tokenize(long)) == expected[1]
    assert len(offloaded) == 1


def test_a_tokenizer_vllm_did_not_make_thread_safe_stays_on_the_renderer_thread():
    from handlers.engines.vllm_openai import tokenize_short_prompts_inline

    async def offloaded(prompt, params):
        return prompt

    renderer = types.SimpleNamespace(
        tokenizer=object(), _tokenize_prompt=lambda p, q: p, _tokenize_prompt_async=offloaded
    )
    assert not tokenize_short_prompts_inline(renderer)
    assert renderer._tokenize_prompt_async is offloaded
